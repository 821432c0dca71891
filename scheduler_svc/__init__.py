"""The scheduler service: public gRPC API, request queue, admission, inflight
batching, KV block allocation, detokenization and streaming. CPU only; talks
to executors through ``executor_client.ExecutorConnection``."""
