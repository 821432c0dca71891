"""Weight and activation quantization for the engine builder.

Quantization is a module swap (gpt-fast style): the builder replaces the
model's ``Linear`` modules with quantized ones that hold packed weights and
scales and call a quantized GEMM plugin; the engine folder stores those
tensors, and loading an engine rebuilds the same modules from the per-layer
records in ``engine.json``.

    quant_mode.py     QuantMode bit mask, algorithm names, valid combinations
    records.py        what the manifest records: per-layer choices, calibration, perplexity
    quantize.py       quantize / dequantize primitives (INT8, INT4 groups, FP8)
    linear.py         the quantized Linear modules
    layer_plan.py     which Linear gets what (exclude patterns), module replacement
    corpus.py         the built-in calibration and held-out texts (stdlib docstrings)
    forward.py        one whole prompt through the model (calibration, perplexity)
    calibration.py    per-layer input activation statistics via forward hooks
    awq.py            activation-aware INT4 scale search
    smoothquant.py    SmoothQuant migration factors and norm folding
    kv_cache.py       FP8 / INT8 KV cache: cache dtype, per-layer K and V scales from calibration
    quantizer.py      build time: quantize a loaded model; load time: rebuild the modules
    kernel_choice.py  timing the quantized GEMM plugins at build time
    perplexity.py     perplexity and the accuracy gate of ``inflight build --validate``

This ``__init__`` imports nothing, so ``build_config`` can import
``quant_mode`` without pulling in torch-heavy modules.
"""
