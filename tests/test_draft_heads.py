"""Draft heads (Medusa and the recurrent EAGLE-style head): what untrained heads
propose, that self-distillation makes them agree with the target more often on
held-out text, that the recurrent head's training and serving paths agree,
their files, and ``inflight train-draft`` end to end.

Training here is deliberately small (16 short texts, a few epochs on the real
SmolLM2 weights): enough to measure a real rise in agreement, not to reach
the agreement a full run gets.
"""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch

from tests.conftest import TEST_DEVICE, tiny_llama_config
from executor_svc.quantization.corpus import encode_texts, held_out_texts
from executor_svc.quantization.forward import PromptForward
from executor_svc.speculative.draft_heads import (
    DraftHeads, RecurrentDraftHead, heads_meta_path, heads_path, load_draft_heads, save_draft_heads,
)
from executor_svc.speculative.chat_prompts import sampled_requests
from executor_svc.speculative.ngram import NgramIndex
from executor_svc.speculative.self_generation import Sampling
from executor_svc.speculative.train_heads import (
    DistillConfig, collect_hidden, distill_heads, head_agreement, self_generate,
)
from inflight.train_draft import add_train_draft_parser, run_train_draft

SMALL_RUN = DistillConfig(
    num_heads=2, kind="medusa", chat=False, num_texts=16, max_tokens_per_text=96, epochs=3, lr=3e-3, batch_rows=32,
    num_eval_texts=6, self_generate=False,  # one forward per text keeps this quick on a CPU; the command's test generates
)


@pytest.fixture(scope="module")
def held_out_hidden(engine) -> list[torch.Tensor]:
    """The target's final hidden states over three held-out texts."""
    texts, _ = held_out_texts(3)
    token_lists = encode_texts(engine.engine_dir, texts, 64)
    config = engine.model_config
    runner = PromptForward.create(engine.model, config, 64, engine.tokens_per_block, engine.device, engine.dtype)
    return collect_hidden(runner, token_lists, "hidden", progress=False)


@pytest.fixture(scope="module")
def trained(engine):
    """Heads distilled from the real target on a small corpus, and the run's report."""
    return distill_heads(engine, SMALL_RUN, progress=False)


@pytest.fixture(scope="module")
def tiny_engine_dir(model_dir, engine, tmp_path_factory):
    """A two-layer random-weight engine with the default model's tokenizer: hidden 64 instead of 576."""
    from executor_svc.build_config import BuildConfig
    from executor_svc.builder import build_engine

    folder = tmp_path_factory.mktemp("tiny-target")
    (folder / "config.json").write_text(json.dumps(tiny_llama_config(engine.model_config.vocab_size, 512)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, folder / name)
    build = BuildConfig(max_batch_size=8, max_num_tokens=512, max_seq_len=256, tokens_per_block=16, dtype="float32")
    build_engine(folder, folder / "engine", build, device=TEST_DEVICE, load_format="dummy", progress=False)
    return folder / "engine"


def test_untrained_heads_propose_the_targets_own_next_token(engine, held_out_hidden):
    hidden = held_out_hidden[0]  # [T, H]
    heads = DraftHeads(3, engine.model_config.hidden_size, engine.model_config.vocab_size).to(engine.device)
    with torch.inference_mode():
        greedy = engine.model.compute_logits(hidden).argmax(-1)  # [T]
        logits = heads(hidden, engine.model)
    assert logits.shape == (hidden.shape[0], 3, engine.model_config.vocab_size) and logits.dtype == torch.float32
    drafts = heads.propose(hidden, engine.model, 2)
    assert drafts.shape == (hidden.shape[0], 2) and drafts.dtype == torch.int64
    # Zero-initialised blocks are the identity: every head repeats the lm_head's argmax.
    assert torch.equal(drafts, greedy[:, None].expand(-1, 2))
    with pytest.raises(ValueError, match="num_tokens"):
        heads.propose(hidden, engine.model, 4)


def test_distillation_raises_held_out_agreement(trained):
    heads, report = trained
    assert heads.num_heads == 2 and len(report.agreement_before) == 2 == len(report.agreement_after)
    assert report.epoch_losses[-1] < report.epoch_losses[0]
    # Untrained, head 0 is right only where the target repeats its previous token (rare);
    # distilled, it must beat that by a clear margin on texts it never saw.
    assert report.agreement_after[0] >= report.agreement_before[0] + 0.03, report
    assert report.agreement_after[1] > report.agreement_before[1], report
    assert min(report.eval_positions) > 300


def test_agreement_counts_what_each_head_gets_right(engine, trained, held_out_hidden):
    heads, _ = trained
    hits, counts = [0, 0], [0, 0]
    with torch.inference_mode():
        for hidden in held_out_hidden:  # one position at a time, straight from the definition
            greedy = engine.model.compute_logits(hidden).argmax(-1).tolist()
            for t in range(hidden.shape[0] - 1):
                logits = heads(hidden[t : t + 1], engine.model)[0]  # [K, V]
                for i in range(2):
                    if t + 1 + i < hidden.shape[0]:
                        hits[i] += int(logits[i].argmax()) == greedy[t + 1 + i]
                        counts[i] += 1
    measured = head_agreement(heads, engine.model, held_out_hidden)
    assert measured.positions == counts
    assert measured.per_draft == pytest.approx([h / c for h, c in zip(hits, counts)], abs=1e-4)
    assert measured.per_draft[0] > 0  # the trained heads do name some tokens right


def test_walk_accepts_what_serving_rounds_would(engine, recurrent_trained, held_out_hidden):
    """The walk's mean is over rounds that start where the round before ended, drafted one round at a time."""
    head, _ = recurrent_trained
    k, accepted, rounds = head.num_heads, 0, 0
    with torch.inference_mode():
        for hidden in held_out_hidden:
            greedy = engine.model.compute_logits(hidden).argmax(-1).tolist()
            position = 0
            while position < hidden.shape[0] - k:  # rounds whose k drafts all lie inside the text
                drafts = head.propose(hidden[position : position + 1], engine.model, k,
                                      torch.tensor(greedy[position : position + 1], device=hidden.device))[0].tolist()
                run = 0
                while run < k and drafts[run] == greedy[position + 1 + run]:
                    run += 1
                accepted, rounds, position = accepted + run, rounds + 1, position + run + 1
    measured = head_agreement(head, engine.model, held_out_hidden)
    assert rounds > 0 and measured.walk_accepted == pytest.approx(accepted / rounds, abs=1e-4)
    assert 0 < measured.walk_accepted <= k


def test_saved_heads_load_back_with_identical_proposals(engine, trained, held_out_hidden, tmp_path):
    heads, report = trained
    path = save_draft_heads(heads, tmp_path, report.to_json())
    assert path == heads_path(tmp_path) and path.is_file()
    meta = json.loads(heads_meta_path(tmp_path).read_text())
    assert meta["num_heads"] == 2 and meta["hidden_size"] == engine.model_config.hidden_size
    assert meta["training"]["agreement_after"] == report.agreement_after
    loaded = load_draft_heads(tmp_path, engine.model_config, engine.device, engine.dtype)
    hidden = torch.cat(held_out_hidden)
    assert torch.equal(loaded.propose(hidden, engine.model, 2), heads.propose(hidden, engine.model, 2))


def test_loading_heads_into_another_shape_or_from_nowhere_fails_clearly(engine, trained, tiny_engine_dir, tmp_path):
    from executor_svc.engine_file import read_manifest

    heads, report = trained
    save_draft_heads(heads, tmp_path, report.to_json())
    tiny_config = read_manifest(tiny_engine_dir).model
    with pytest.raises(ValueError, match=r"draft_heads\.safetensors.*hidden size 576.*hidden size 64"):
        load_draft_heads(tmp_path, tiny_config, engine.device, engine.dtype)
    with pytest.raises(FileNotFoundError, match=r"draft_heads\.safetensors.*inflight train-draft"):
        load_draft_heads(tiny_engine_dir, tiny_config, engine.device, engine.dtype)


def test_self_generated_text_is_the_targets_own_greedy_continuation(engine):
    texts, _ = held_out_texts(3)
    prompts = [ids[:n] for ids, n in zip(encode_texts(engine.engine_dir, texts, 16), (8, 3, 12))]
    generated = self_generate(engine, prompts, 24, eos_ids=set(), progress=False)
    assert [len(g) for g in generated] == [24, 24, 24]
    runner = PromptForward.create(engine.model, engine.model_config, 24, engine.tokens_per_block, engine.device,
                                  engine.dtype)
    for prompt, tokens in zip(prompts, generated):
        assert tokens[: len(prompt)] == prompt
        with torch.inference_mode():  # teacher-forced over the result, the target picks every generated token
            greedy = engine.model.compute_logits(runner.hidden_states(tokens)).argmax(-1).tolist()
        assert tokens[len(prompt) :] == greedy[len(prompt) - 1 : -1]


@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.0, 0.8)])
def test_sampling_draws_from_the_distribution_it_names(temperature, top_p):
    """Self-generation's sampler against the distribution it claims: softmax(logits / T), cut to the smallest set
    of most likely tokens whose mass reaches top_p (the first always kept) and renormalised."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    draws = 40_000
    drawn = Sampling(temperature, top_p, seed=1).draw(logits.expand(draws, -1))
    frequency = torch.bincount(drawn, minlength=5).double() / draws
    probs = torch.softmax(logits.double() / temperature, -1)  # already sorted, most likely first
    kept = (probs.cumsum(0) - probs) < top_p
    expected = torch.where(kept, probs, 0.0) / probs[kept].sum()
    assert kept.sum() == (5 if top_p == 1.0 else 2)  # 0.64 + 0.23 reach 0.8: the nucleus is two tokens
    sigma = (expected * (1 - expected) / draws).sqrt()
    assert ((frequency - expected).abs() <= 5 * sigma + 1e-12).all(), (frequency, expected)
    assert torch.equal(Sampling(temperature, top_p, seed=1).draw(logits.expand(draws, -1)), drawn)  # seeded
    for bad in ({"temperature": 0.0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            Sampling(**bad)


def test_requests_the_target_writes_fill_the_user_turn_of_its_chat_template(engine):
    """Magpie's recipe: the target continues its chat template cut where the user's message begins. Each request is
    distinct and ended within the limit (its turn closed), and the seed makes them again."""
    from scheduler_svc.tokenizer import Tokenizer

    requests = sampled_requests(engine, 5, seed=0, progress=False)
    assert 1 <= len(requests) <= 5 and len({r.casefold() for r in requests}) == len(requests)
    assert all(r and r == r.strip() for r in requests)
    assert sampled_requests(engine, 5, seed=0, progress=False) == requests
    tokenizer = Tokenizer(engine.engine_dir)
    rendered = tokenizer.hf.apply_chat_template([{"role": "user", "content": requests[0]}], tokenize=False,
                                                add_generation_prompt=False)
    assert requests[0] in rendered and rendered.index(requests[0]) > 0  # after the system turn and the user's tag


def test_chat_requests_mixed_from_both_sources_train_heads(engine):
    config = DistillConfig(num_heads=2, requests="mixed", num_texts=4, max_tokens_per_text=72, epochs=1,
                           num_eval_texts=2, batch_rows=32)
    heads, report = distill_heads(engine, config, progress=False)
    assert report.data.startswith("2 built-in and 2 target-written chat requests") and report.num_texts == 4
    assert report.num_tokens > 0 and len(report.agreement_after) == 2
    with pytest.raises(ValueError, match="requests must be one of builtin, sampled, mixed"):
        DistillConfig(requests="web")
    for elsewhere in ({"data": "requests.txt"}, {"chat": False}):
        with pytest.raises(ValueError, match="it needs chat and no data"):
            DistillConfig(requests="sampled", **elsewhere)


def _cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="inflight")
    add_train_draft_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["train-draft", *argv])


def test_train_draft_command_writes_heads_the_engine_can_load(tiny_engine_dir, tmp_path, capsys):
    from executor_svc.engine_file import read_manifest

    assert run_train_draft(_cli(str(tmp_path), "--device", "cpu")) == 2  # not an engine folder
    assert "not an engine folder" in capsys.readouterr().err
    argv = ["--num-heads", "2", "--num-texts", "4", "--max-tokens-per-text", "72", "--epochs", "1",
            "--num-eval-texts", "2", "--device", TEST_DEVICE]  # the defaults: a recurrent head, chat answers
    assert run_train_draft(_cli(str(tiny_engine_dir), *argv)) == 0
    out = capsys.readouterr().out
    assert "draft 0 (token t+2)" in out and "draft 1 (token t+3)" in out and "recurrent" in out
    meta = json.loads(heads_meta_path(tiny_engine_dir).read_text())
    training = meta["training"]
    assert meta["kind"] == "recurrent" and meta["num_heads"] == 2 and meta["hidden_size"] == 64
    assert training["self_generate"] and "chat" in training["data"] and "chat" in training["eval_data"]
    assert training["num_texts"] == 4 and len(training["agreement_after"]) == 2
    # Only answer positions count: the first row of each text chooses its first answer token.
    assert 4 <= training["num_tokens"] <= 4 * 72 - 4 * 30
    config = read_manifest(tiny_engine_dir).model
    heads = load_draft_heads(tiny_engine_dir, config, torch.device(TEST_DEVICE), torch.float32)
    assert isinstance(heads, RecurrentDraftHead) and heads.num_heads == 2
    assert heads.w_out.abs().sum() > 0  # trained, not the zero initialisation
    # Medusa heads and a bad kind through the same command.
    assert run_train_draft(_cli(str(tiny_engine_dir), *argv, "--kind", "medusa", "--no-chat", "--no-self-generate")) == 0
    medusa = load_draft_heads(tiny_engine_dir, config, torch.device(TEST_DEVICE), torch.float32)
    assert isinstance(medusa, DraftHeads) and medusa.weight.abs().sum() > 0
    assert run_train_draft(_cli(str(tiny_engine_dir), *argv, "--no-chat")) == 0  # docstring continuations
    assert run_train_draft(_cli(str(tiny_engine_dir), *argv, "--no-self-generate")) == 2  # chat needs answers
    assert "self_generate" in capsys.readouterr().err
    # Heads saved in a folder of their own, which serving names with --draft-heads; the engine's stay as they were.
    before = heads_path(tiny_engine_dir).read_bytes()
    assert run_train_draft(_cli(str(tiny_engine_dir), *argv, "--output", str(tmp_path / "heads"))) == 0
    assert f"--draft-heads {tmp_path / 'heads'}" in capsys.readouterr().out
    assert heads_path(tiny_engine_dir).read_bytes() == before
    assert isinstance(load_draft_heads(tmp_path / "heads", config, torch.device(TEST_DEVICE), torch.float32),
                      RecurrentDraftHead)
    (tmp_path / "file").write_text("")
    assert run_train_draft(_cli(str(tiny_engine_dir), *argv, "--output", str(tmp_path / "file" / "heads"))) == 2
    assert "--output" in capsys.readouterr().err
    # Random weights never end a user's turn: asked for requests the target writes, the command says so.
    assert run_train_draft(_cli(str(tiny_engine_dir), *argv, "--requests", "sampled")) == 2
    assert "wrote no request" in capsys.readouterr().err
    # A draft vocabulary: recorded with the counts it came from, loaded as saved or as serving asks.
    assert run_train_draft(_cli(str(tiny_engine_dir), *argv, "--draft-vocab", "64")) == 0
    assert "drafts from the 64 most used tokens" in capsys.readouterr().out
    meta = json.loads(heads_meta_path(tiny_engine_dir).read_text())
    assert meta["format"] == 3 and meta["draft_vocab_size"] == 64 and meta["training"]["draft_vocab_size"] == 64
    assert 0 < meta["training"]["draft_vocab_coverage"] <= 1
    heads = load_draft_heads(tiny_engine_dir, config, torch.device(TEST_DEVICE), torch.float32)
    assert heads.draft_vocab.shape == (64,) and int(heads.token_counts.sum()) > 0
    assert load_draft_heads(tiny_engine_dir, config, torch.device(TEST_DEVICE), torch.float32, 0).draft_vocab is None
    assert run_train_draft(_cli(str(tiny_engine_dir), *argv, "--draft-vocab", "-1")) == 2
    assert "draft_vocab must be at least 0" in capsys.readouterr().err


# -- the recurrent (EAGLE-style) head ----------------------------------------------------------


@pytest.fixture(scope="module")
def recurrent_trained(engine):
    """A recurrent head distilled on the target's answers to 12 built-in chat requests (the default data, small:
    half the texts of earlier versions of this fixture, which took 110-160 s of the suite on 2 cores; trained
    on 12, the first draft's held-out agreement still rises from 0.01 to 0.09)."""
    config = DistillConfig(
        num_heads=3, kind="recurrent", num_texts=12, max_tokens_per_text=128, epochs=4, lr=3e-3, batch_rows=32,
        num_eval_texts=6,
    )
    return distill_heads(engine, config, progress=False)


def test_untrained_recurrent_head_repeats_the_targets_choice(engine, held_out_hidden):
    hidden = held_out_hidden[0]
    head = RecurrentDraftHead(3, engine.model_config.hidden_size, engine.model_config.vocab_size).to(engine.device)
    with torch.inference_mode():
        greedy = engine.model.compute_logits(hidden).argmax(-1)
        drafts = head.propose(hidden, engine.model, 3, greedy)
    # W_out starts at zero: the state never moves, so every draft is the token the target just chose.
    assert drafts.shape == (hidden.shape[0], 3) and torch.equal(drafts, greedy[:, None].expand(-1, 3))
    with pytest.raises(ValueError, match="next_tokens"):
        head.propose(hidden, engine.model, 2)
    with pytest.raises(ValueError, match="num_tokens"):
        head.propose(hidden, engine.model, 4, greedy)


def test_recurrent_training_and_serving_paths_agree(engine, recurrent_trained, held_out_hidden):
    """Fed its own drafts, the teacher-forced training forward picks exactly what ``propose`` drafted, among the
    tokens of the draft vocabulary ``propose`` drafts from (the training forward scores every token)."""
    head, _ = recurrent_trained
    assert head.draft_vocab is not None  # trained with the default vocabulary
    hidden = held_out_hidden[1][:40]
    with torch.inference_mode():
        first = engine.model.compute_logits(hidden).argmax(-1)
        drafts = head.propose(hidden, engine.model, 3, first)  # [N, 3]
        fed = torch.cat([first[:, None], drafts[:, :2]], dim=1)  # step i is fed the token before draft i
        logits, states = head(hidden, engine.model, fed)
    assert states.shape == (40, 3, engine.model_config.hidden_size)
    assert torch.equal(head.vocab_ids(logits.index_select(-1, head.draft_vocab).argmax(-1)), drafts)


def test_recurrent_distillation_makes_chains_accepted(recurrent_trained):
    head, report = recurrent_trained
    assert report.kind == "recurrent" and report.epoch_losses[-1] < report.epoch_losses[0]
    assert report.agreement_after[0] >= report.agreement_before[0] + 0.05, report
    # Untrained, a chain is accepted only where the target repeats a token; trained, clearly more often.
    assert report.mean_accepted_after > report.mean_accepted_before + 0.05, report


def test_saved_recurrent_head_loads_back_with_identical_drafts(engine, recurrent_trained, held_out_hidden, tmp_path):
    head, report = recurrent_trained
    save_draft_heads(head, tmp_path, report.to_json())
    meta = json.loads(heads_meta_path(tmp_path).read_text())
    assert meta["kind"] == "recurrent" and meta["intermediate_size"] == 2 * engine.model_config.hidden_size
    loaded = load_draft_heads(tmp_path, engine.model_config, engine.device, engine.dtype)
    assert isinstance(loaded, RecurrentDraftHead)
    hidden = torch.cat(held_out_hidden)
    with torch.inference_mode():
        first = engine.model.compute_logits(hidden).argmax(-1)
    assert torch.equal(loaded.propose(hidden, engine.model, 3, first), head.propose(hidden, engine.model, 3, first))
    meta["kind"] = "tree"  # a kind this version does not know
    heads_meta_path(tmp_path).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="unknown draft head kind 'tree'"):
        load_draft_heads(tmp_path, engine.model_config, engine.device, engine.dtype)


def test_recurrent_head_with_input_norms_steps_on_normalised_inputs_and_loads_back(engine, held_out_hidden, tmp_path):
    config = engine.model_config
    torch.manual_seed(0)
    head = RecurrentDraftHead(3, config.hidden_size, config.vocab_size, input_norm=True).to(engine.device)
    with torch.no_grad():
        head.w_out.normal_(std=0.01)
        head.norm_state.uniform_(0.5, 1.5)
        head.norm_embed.uniform_(0.5, 1.5)
    hidden = torch.cat(held_out_hidden)[:32]
    with torch.inference_mode():
        first = engine.model.compute_logits(hidden).argmax(-1)
        embedding = engine.model.embed_tokens(first)
        plain = RecurrentDraftHead(3, config.hidden_size, config.vocab_size).to(engine.device)
        plain.load_state_dict({name: t for name, t in head.state_dict().items() if not name.startswith("norm_")})
        scaled = [x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * g  # RMS norms, written out
                  for x, g in ((hidden, head.norm_state), (embedding, head.norm_embed))]
        expected = hidden + (plain.step(*scaled) - scaled[0])  # the block's update added to the raw state
        assert torch.allclose(head.step(hidden, embedding), expected, atol=1e-5)
        save_draft_heads(head, tmp_path, {})
        assert json.loads(heads_meta_path(tmp_path).read_text())["input_norm"] is True
        loaded = load_draft_heads(tmp_path, config, engine.device, engine.dtype)
        assert loaded.input_norm and torch.equal(loaded.norm_embed, head.norm_embed)
        assert torch.equal(loaded.propose(hidden, engine.model, 3, first), head.propose(hidden, engine.model, 3, first))


def _torch_chain(head: RecurrentDraftHead, hidden, model, num_tokens: int, first) -> torch.Tensor:
    """``head.propose`` through torch's kernels (never the Triton chain), the oracle of ``heads_triton``."""
    head.fused = False
    try:
        return head.propose(hidden, model, num_tokens, first)
    finally:
        head.fused = True


@pytest.mark.parametrize("vocab", [0, 256])
def test_triton_chain_drafts_what_the_torch_chain_drafts(engine, recurrent_trained, held_out_hidden, vocab):
    """The four-kernel chain (interpreted on a CPU) against torch's, on the real target and a trained head,
    drafting from every token and from a draft vocabulary of 256."""
    from executor_svc.speculative import heads_triton

    # The interpreter runs one program at a time: on a CPU, fewer and wider blocks.
    config = heads_triton.ChainConfig(block_hidden=256, block_vocab=2048) if engine.device.type == "cpu" else None
    head, _ = recurrent_trained
    model = engine.model
    hidden = held_out_hidden[2][5:7]  # two rows
    trained_with = head.draft_vocab_size
    head.use_draft_vocab(vocab)
    try:
        with torch.inference_mode():
            first = model.compute_logits(hidden).argmax(-1)
            head_rows = model.lm_head.weight if vocab == 0 else head.vocab_weight(model)
            parts = (model.embed_tokens.weight, head.w_in, head.b_in, head.w_out, head.b_out, head_rows)
            assert heads_triton.fits(hidden, list(parts))
            # One row is the odd-shapes test's.
            got = heads_triton.recurrent_drafts(hidden, first, *parts, 3, config, vocab_ids=head.draft_vocab)
            assert torch.equal(got, _torch_chain(head, hidden, model, 3, first))
    finally:
        head.use_draft_vocab(trained_with)
    assert not heads_triton.fits(hidden[:1].expand(heads_triton.MAX_ROWS + 1, -1).contiguous(), list(parts))
    assert not heads_triton.fits(hidden.half(), list(parts))


def _odd_shaped_chain(seed: int, max_drafts: int):
    """A random recurrent head, embedding and LM head of sizes that fill no block exactly (hidden 40, inner 76,
    vocabulary 101): (generator, head, embed, lm) with ``generator`` ready for the test's own draws."""
    gen = torch.Generator().manual_seed(seed)
    dim, inner, vocab = 40, 76, 101
    head = RecurrentDraftHead(max_drafts, dim, vocab, intermediate_size=inner)
    with torch.no_grad():
        for p in (head.w_in, head.b_in, head.w_out, head.b_out):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return gen, head, torch.randn(vocab, dim, generator=gen), torch.randn(vocab, dim, generator=gen)


def test_triton_chain_on_odd_shapes_and_ties():
    """Sizes that fill no block exactly, and logits tied exactly (the lowest token id wins, as torch.argmax)."""
    from executor_svc.speculative import heads_triton

    gen, head, embed, lm = _odd_shaped_chain(3, 4)
    dim, vocab = lm.shape[1], lm.shape[0]
    lm[70:] = lm[30:61]  # ids 70..100 repeat 30..60: every one of those logits ties with a lower id
    hidden = torch.randn(5, dim, generator=gen)
    first = torch.randint(0, vocab, (5,), generator=gen)

    def reference(num_tokens: int) -> torch.Tensor:  # the chain written out in torch, float32
        state, token, out = hidden, first, []
        for _ in range(num_tokens):
            state = head.step(state, embed[token])
            token = (state @ lm.t()).argmax(-1)
            out.append(token)
        return torch.stack(out, dim=1)

    with torch.inference_mode():
        expected = reference(4)
        device = torch.device(TEST_DEVICE)  # a GPU's kernels, or the CPU's interpreter
        parts = [t.detach().to(device) for t in (embed, head.w_in, head.b_in, head.w_out, head.b_out, lm)]
        # The default tiles (one step along K here), and narrow ones that loop along K in partial steps.
        narrow = heads_triton.ChainConfig(block_hidden=16, block_k_hidden=16, block_vocab=16, block_k_vocab=16)
        for config in (None, narrow):
            got = heads_triton.recurrent_drafts(hidden.to(device), first.to(device), *parts, 4, config).cpu()
            assert torch.equal(got, expected)
        assert (got < 70).all()  # a tied maximum never goes to the repeated (higher) id
        one = heads_triton.recurrent_drafts(hidden[:1].to(device), first[:1].to(device), *parts, 1).cpu()
        assert torch.equal(one, expected[:1, :1])


def test_triton_chain_drafts_from_a_draft_vocabulary():
    """With a draft vocabulary the chain's LM head reads only those rows and maps its pick to their token ids:
    the argmax over the vocabulary's ids (ties to the lowest id), as the torch chain restricted to them."""
    from executor_svc.speculative import heads_triton

    gen, head, embed, lm = _odd_shaped_chain(5, 3)
    dim, vocab = lm.shape[1], lm.shape[0]
    lm[90:] = lm[20:31]  # ids 90..100 tie with 20..30
    ids = torch.tensor(sorted(set(range(0, 101, 3)) | set(range(20, 31)) | set(range(90, 101))))
    hidden = torch.randn(3, dim, generator=gen)
    first = torch.randint(0, vocab, (3,), generator=gen)
    state, token, expected = hidden, first, []
    with torch.inference_mode():
        for _ in range(3):
            state = head.step(state, embed[token])
            token = ids[(state @ lm[ids].t()).argmax(-1)]
            expected.append(token)
        expected = torch.stack(expected, dim=1)
        device = torch.device(TEST_DEVICE)
        parts = [t.detach().to(device) for t in (embed, head.w_in, head.b_in, head.w_out, head.b_out, lm[ids])]
        narrow = heads_triton.ChainConfig(block_hidden=16, block_k_hidden=16, block_vocab=16, block_k_vocab=16)
        got = heads_triton.recurrent_drafts(hidden.to(device), first.to(device), *parts, 3, narrow,
                                            vocab_ids=ids.to(device)).cpu()
    assert torch.equal(got, expected)
    assert torch.isin(got, ids).all() and not ((got >= 90) & (got <= 100)).any()  # ties went to the lower ids


def test_draft_vocabulary_keeps_the_most_used_tokens_and_drafts_only_those(engine, recurrent_trained,
                                                                              held_out_hidden, tmp_path):
    """The heads' draft vocabulary is the training answers' most used tokens; drafting from it gives the torch
    chain restricted to those tokens' logits, and it survives a save and load (or serving asks another size)."""
    head, report = recurrent_trained
    counts = head.token_counts
    assert counts is not None and counts.shape == (engine.model_config.vocab_size,)
    assert int(counts.sum()) == report.num_tokens - report.num_texts  # every answer token but each text's first row
    hidden, model = torch.cat(held_out_hidden)[:24], engine.model
    trained_with = head.draft_vocab_size
    with torch.inference_mode():
        head.use_draft_vocab(0)
        greedy = model.compute_logits(hidden).argmax(-1)
        whole = head.propose(hidden, model, 3, greedy)
        head.use_draft_vocab(256)
        try:
            ids = head.draft_vocab.cpu()
            assert ids.shape == (256,) and torch.equal(ids, ids.sort().values)
            assert counts[ids].min() >= counts[~torch.isin(torch.arange(len(counts)), ids)].max()
            drafts = head.propose(hidden, model, 3, greedy)
            state, token, expected = hidden, greedy, []
            for _ in range(3):  # the chain written out: the logits of the vocabulary's tokens only
                state = head.step(state, model.embed_tokens(token))
                logits = torch.nn.functional.linear(state, model.lm_head.weight[head.draft_vocab])
                token = head.draft_vocab[logits.argmax(-1)]
                expected.append(token)
            assert torch.equal(drafts, torch.stack(expected, dim=1))
            assert torch.isin(drafts.cpu(), ids).all() and 0 < head.vocab_coverage() < 1
            save_draft_heads(head, tmp_path, report.to_json())
            head.use_draft_vocab(0)
            assert torch.equal(head.propose(hidden, model, 3, greedy), whole)
        finally:
            head.use_draft_vocab(trained_with)
        loaded = load_draft_heads(tmp_path, engine.model_config, engine.device, engine.dtype)
        assert torch.equal(loaded.propose(hidden, model, 3, greedy), drafts)
        wider = load_draft_heads(tmp_path, engine.model_config, engine.device, engine.dtype, draft_vocab=1024)
        assert wider.draft_vocab.shape == (1024,)
    bare = RecurrentDraftHead(3, engine.model_config.hidden_size, engine.model_config.vocab_size)
    with pytest.raises(ValueError, match="without the training answers' token counts"):
        bare.use_draft_vocab(16)
    with pytest.raises(ValueError, match="at least 0"):
        bare.use_draft_vocab(-1)


def _greedy_chain_walk(drafts: list[list[int]], text: list[int], first_row: int, max_tokens: int) -> int:
    """Drafts a greedy chain would accept over ``text`` (prompt + output) when each step verifies the heads'
    drafts from the row that chose its newest token (``drafts[t]``: the heads' drafts from row t)."""
    row, emitted, accepted = first_row, 1, 0
    while emitted < max_tokens:
        k = min(len(drafts[row]), max_tokens - emitted - 1)
        run = 0
        while run < k and drafts[row][run] == text[row + 2 + run]:
            run += 1
        accepted += run
        emitted += run + 1
        row += run + 1
    return accepted


def _served_texts_and_drafts(engine, tokenizer, head, prompts, outputs):
    """For each prompt and its served output: (prompt ids, prompt + output, the heads' drafts from every row of
    that text, as ``head.propose`` makes them from the target's hidden states offline)."""
    runner = PromptForward.create(engine.model, engine.model_config, 128, engine.tokens_per_block, engine.device,
                                  engine.dtype)
    for prompt, output in zip(prompts, outputs):
        prompt_ids = tokenizer.encode(prompt)
        text = prompt_ids + output
        hidden = collect_hidden(runner, [text], "hidden", progress=False)[0]
        with torch.inference_mode():
            greedy = engine.model.compute_logits(hidden).argmax(-1)
            drafts = head.propose(hidden, engine.model, head.num_heads, greedy).tolist()
        yield prompt_ids, text, drafts


def _lookup_chain_walk(
    drafts: list[list[int]], text: list[int], first_row: int, max_tokens: int, width: int, lookup: tuple[int, int],
    padded: bool,
) -> int:
    """``_greedy_chain_walk`` with ``heads_lookup``: where prompt lookup over the tokens so far finds a match, its
    drafts (up to ``width``) replace the heads'; with ``padded`` (chained rounds) every step verifies ``width``
    drafts, the missing ones the newest token repeated."""
    row, emitted, accepted = first_row, 1, 0
    while emitted < max_tokens:
        known = text[: row + 2]  # the prompt and the output up to the newest token
        guess = NgramIndex(*lookup).propose(known, width) or drafts[row]
        if padded:
            guess = guess + [known[-1]] * (width - len(guess))
        k = min(len(guess), max_tokens - emitted - 1)
        run = 0
        while run < k and guess[run] == text[row + 2 + run]:
            run += 1
        accepted += run
        emitted += run + 1
        row += run + 1
    return accepted


@pytest.mark.parametrize("rounds", [1, 3])
def test_serving_with_lookup_accepts_what_the_heads_and_the_lookup_draft_offline(
    engine, tokenizer, recurrent_trained, tmp_path, rounds,
):
    """Heads with prompt lookup (``heads_lookup``): greedy serving gives the tokens of plain decoding and accepts,
    draft for draft, what an offline walk over the same text accepts when the lookup's drafts are taken wherever
    it finds a match, up to more drafts than the heads make, and the heads' elsewhere."""
    import dataclasses

    from executor_svc.speculative.proposer import SpeculativeConfig, SpeculativeMode
    from tests.conftest import PROMPTS
    from tests.test_speculative import COPY_PROMPTS, _generate

    head, _ = recurrent_trained
    save_draft_heads(head, tmp_path, {"test": True})
    width, lookup = head.num_heads + 2, (2, 4)
    speculative = SpeculativeConfig(SpeculativeMode.DRAFT_HEADS, width, ngram_max=lookup[1], max_rounds=rounds,
                                    heads_lookup=lookup[0])
    spec = dataclasses.replace(engine, engine_dir=tmp_path, speculative=speculative)
    prompts, max_tokens = COPY_PROMPTS[:2] + PROMPTS[:2], 20
    outputs, usages, _ = _generate(spec, tokenizer, prompts, {"adaptive_draft_length": False}, max_tokens=max_tokens)
    plain, _, _ = _generate(engine, tokenizer, prompts, max_tokens=max_tokens)
    assert outputs == plain
    served = [usage.num_accepted_draft_tokens for usage in usages]
    walked, heads_alone = [], []
    for prompt_ids, text, drafts in _served_texts_and_drafts(engine, tokenizer, head, prompts, outputs):
        walked.append(_lookup_chain_walk(drafts, text, len(prompt_ids) - 1, max_tokens, width, lookup, rounds > 1))
        heads_alone.append(_greedy_chain_walk(drafts, text, len(prompt_ids) - 1, max_tokens))
    assert served == walked
    # The copy prompts repeat themselves: there the lookup's drafts get more accepted than the heads' alone would.
    assert sum(served[:2]) > sum(heads_alone[:2])
    # Sampled requests verify the same drafts by rejection sampling (the eager rounds); no KV block is left behind.
    sampled, _, stats = _generate(spec, tokenizer, prompts[:2], sampling={"temperature": 0.8, "seed": 3})
    assert [len(o) for o in sampled] == [20, 20] and stats.drafts.num_draft_tokens > 0


@pytest.mark.parametrize("rounds", [1, 3])
def test_serving_accepts_exactly_what_the_heads_draft_offline(engine, tokenizer, recurrent_trained, tmp_path, rounds):
    """Greedy serving accepts, draft for draft, what the trained head proposes from the target's hidden states of
    the same text (host proposals between steps, and the device chain between chained rounds): a wrong hidden row
    or last token would change no output, only acceptance, which no token-equality test can see."""
    import dataclasses

    from executor_svc.speculative.proposer import SpeculativeConfig, SpeculativeMode
    from tests.conftest import PROMPTS
    from tests.test_speculative import COPY_PROMPTS, _generate

    head, _ = recurrent_trained
    trained_with = head.draft_vocab_size
    # Saved drafting from every token, or (three rounds) from a draft vocabulary of 256: the chain's and the
    # host's drafts come from it.
    head.use_draft_vocab(256 if rounds == 3 else 0)
    try:
        save_draft_heads(head, tmp_path, {"test": True})
    finally:
        head.use_draft_vocab(trained_with)
    # The heads next to the engine, or (three rounds) in a folder named by the configuration (--draft-heads).
    speculative = SpeculativeConfig(SpeculativeMode.DRAFT_HEADS, head.num_heads, max_rounds=rounds,
                                    draft_heads_dir=tmp_path if rounds == 3 else None)
    spec = dataclasses.replace(engine, engine_dir=engine.engine_dir if rounds == 3 else tmp_path,
                               speculative=speculative)
    prompts, max_tokens = COPY_PROMPTS[:2] + PROMPTS[:3], 20
    outputs, usages, _ = _generate(spec, tokenizer, prompts, {"adaptive_draft_length": False}, max_tokens=max_tokens)
    served = [usage.num_accepted_draft_tokens for usage in usages]
    offline = load_draft_heads(tmp_path, engine.model_config, engine.device, engine.dtype)  # as saved
    assert (offline.draft_vocab is not None) == (rounds == 3)
    walked = [
        _greedy_chain_walk(drafts, text, len(prompt_ids) - 1, max_tokens)
        for prompt_ids, text, drafts in _served_texts_and_drafts(engine, tokenizer, offline, prompts, outputs)
    ]
    assert served == walked
    assert sum(served) > 0  # the trained head gets some drafts right: the comparison is not of zeros


def test_steps_keep_hidden_rows_only_when_a_request_wants_drafts(engine, recurrent_trained, tmp_path):
    """The heads draft from a step's hidden rows, so a step keeps a copy of them for the proposer; a step in
    which no request is asked for drafts (the load-aware policy drafting nothing) keeps none, and still samples
    what plain decoding samples. A request asked for drafts gets them from the same step's rows."""
    import dataclasses

    from executor_svc.runner import ModelRunner
    from executor_svc.speculative.proposer import SpeculativeConfig, SpeculativeMode
    from protos.plan import NewRequest, SamplingConfig, StepPlan

    head, _ = recurrent_trained
    save_draft_heads(head, tmp_path, {"test": True})
    spec = dataclasses.replace(engine, engine_dir=tmp_path,
                               speculative=SpeculativeConfig(SpeculativeMode.DRAFT_HEADS, head.num_heads))
    greedy, prompt = SamplingConfig(temperature=0.0), list(range(100, 112))

    def first_step(drafts: int):
        runner = ModelRunner(spec)
        step = runner.launch(StepPlan(1, new_requests=[
            NewRequest("a", prompt, len(prompt), 0, len(prompt), [0], greedy, num_drafts_to_propose=drafts),
        ]))
        kept = step.hidden
        result = runner.finish(step)
        assert not result.request_errors
        return kept, result.outputs[0]

    kept, output = first_step(0)
    assert kept is None and output.next_draft_token_ids == []
    kept, drafted = first_step(head.num_heads)
    assert kept is not None and kept.shape == (1, engine.model_config.hidden_size)
    assert drafted.token_ids == output.token_ids and len(drafted.next_draft_token_ids) == head.num_heads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_heads_train_through_the_lm_head_at_any_row_count(dtype):
    """Distillation backpropagates through the target's LM head. A GPU's 16-bit head of 17 or more rows writes
    float32 logits from its GEMM, which has no derivative: with gradients wanted, the plain GEMM runs."""
    from executor_svc.model.llama import FLOAT32_OUT_MIN_ROWS, Linear, float32_logits
    from plugins.kernels import Kernels

    device = torch.device(TEST_DEVICE)
    if dtype == torch.bfloat16 and device.type != "cuda":
        pytest.skip("16-bit heads are served on a GPU")
    gen = torch.Generator().manual_seed(0)
    # The 16-bit GEMV on a GPU (it takes no float32 weights); the default kernels otherwise.
    kernels = Kernels.from_names({"gemm": "triton_gemv"} if dtype == torch.bfloat16 else {}, device, dtype)
    head = Linear(64, 500, kernels).to(device=device, dtype=dtype).requires_grad_(False)
    head.weight.copy_(torch.randn(500, 64, generator=gen).to(device=device, dtype=dtype))
    rows = torch.randn(FLOAT32_OUT_MIN_ROWS + 7, 64, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    logits = float32_logits(head, rows)
    assert logits.dtype == torch.float32 and logits.requires_grad
    logits.logsumexp(-1).sum().backward()
    assert rows.grad is not None and torch.isfinite(rows.grad).all() and rows.grad.abs().sum() > 0
    with torch.no_grad():  # serving: the float32-output GEMM where there is one, the same logits to rounding
        served = float32_logits(head, rows)
    torch.testing.assert_close(served, logits.detach(), rtol=2e-2, atol=2e-2)
