"""bench/draft_feature_study.py: its layer taps read what transformers reports, and its head is the served one
until it learns from the features, which train_heads and head_agreement hand it row for row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from draft_feature_study import LayerFeatureHead, LayerTap  # noqa: E402

from executor_svc.speculative.draft_heads import RecurrentDraftHead  # noqa: E402
from executor_svc.speculative.train_heads import DistillConfig, head_agreement, train_heads  # noqa: E402

HIDDEN, VOCAB = 32, 40


class TinyTarget(nn.Module):
    """The two parts of a target a draft head reads: its token embedding and its LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def test_layer_tap_records_the_residual_streams_transformers_reports(engine, hf_model, tokenizer) -> None:
    from executor_svc.speculative.train_heads import prompt_runner

    ids = tokenizer.encode("The residual stream after a few layers of the target")
    layers = [2, 15, 27]
    with LayerTap(engine.model, layers) as tap:
        prompt_runner(engine, 64).hidden_states(ids)
    assert len(tap.outputs) == 1 and tap.outputs[0].shape == (3, len(ids), engine.model_config.hidden_size)
    with torch.no_grad():
        reported = hf_model(torch.tensor([ids], device=engine.device), output_hidden_states=True).hidden_states
    for n, recorded in zip(layers, tap.outputs[0]):
        torch.testing.assert_close(recorded, reported[n][0].float(), rtol=1e-4, atol=1e-4)
    prompt_runner(engine, 64).hidden_states(ids)  # closed: records no more
    assert len(tap.outputs) == 1


def test_a_head_whose_fusion_is_zero_drafts_as_the_recurrent_head() -> None:
    torch.manual_seed(0)
    target = TinyTarget()
    torch.manual_seed(1)
    plain = RecurrentDraftHead(3, HIDDEN, VOCAB)
    torch.manual_seed(1)
    fusing = LayerFeatureHead(3, HIDDEN, VOCAB, num_features=2 * HIDDEN)
    with torch.no_grad():  # a block that is not the zero start of w_out, so that drafts depend on it
        for head in (plain, fusing):
            head.w_out.copy_(torch.randn(HIDDEN, head.intermediate_size, generator=torch.Generator().manual_seed(2)))
    hidden, tokens = torch.randn(16, HIDDEN), torch.randint(0, VOCAB, (16, 3))
    features = torch.randn(16, 2 * HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(fusing(hidden, target, tokens, features), plain(hidden, target, tokens))
    assert torch.equal(fusing.propose(hidden, target, 3, tokens[:, 0], features),
                       plain.propose(hidden, target, 3, tokens[:, 0]))
    with torch.no_grad():
        fusing.w_fuse.normal_()
    assert not torch.equal(fusing.propose(hidden, target, 3, tokens[:, 0], features),
                           plain.propose(hidden, target, 3, tokens[:, 0]))


def _texts(target: TinyTarget, count: int) -> tuple[list, list, list]:
    """Random hidden rows with the target's tokens (row r holds the token row r - 1 chose) and features that name
    the token the first draft at each row must guess (the target's argmax one row on) by its LM-head direction."""
    codes = 4 * target.lm_head.weight / target.lm_head.weight.norm(dim=1, keepdim=True)
    hidden_lists, token_lists, feature_lists = [], [], []
    for _ in range(count):
        hidden = torch.randn(24, HIDDEN)
        greedy = target.compute_logits(hidden).argmax(-1)  # the token after each row
        hidden_lists.append(hidden)
        token_lists.append(torch.cat([torch.zeros(1, dtype=torch.int64), greedy[:-1]]))
        feature_lists.append(codes[torch.cat([greedy[1:], greedy[-1:]])])
    return hidden_lists, token_lists, feature_lists


def test_features_reach_the_head_row_for_row_in_training_and_judging() -> None:
    """Trained on features that name the first draft's answer, the fusing head gets that draft right on new texts far
    more often than the served head, which sees random states: it can only if train_heads and head_agreement hand
    it each row's own features."""
    torch.manual_seed(0)
    target = TinyTarget().requires_grad_(False)
    train, held_out = _texts(target, 32), _texts(target, 8)
    config = DistillConfig(num_heads=2, epochs=20, lr=1e-2, batch_rows=64, num_texts=32, draft_vocab=0,
                           hidden_loss_weight=0.0)
    agreement = {}
    for name in ("served", "fusing"):
        torch.manual_seed(3)
        head = (RecurrentDraftHead(2, HIDDEN, VOCAB) if name == "served"
                else LayerFeatureHead(2, HIDDEN, VOCAB, num_features=HIDDEN))
        fed = name == "fusing"
        train_heads(head, target, train[0], train[1], config, progress=False, feature_lists=train[2] if fed else None)
        agreement[name] = head_agreement(head.eval(), target, held_out[0], held_out[2] if fed else None).per_draft[0]
    assert agreement["fusing"] > 0.5 and agreement["served"] < 0.2, agreement


@pytest.mark.timeout(200)
def test_draft_feature_study_smoke(tmp_path: Path) -> None:
    """The study end to end on SmolLM2: a few short answers read back with their requests, both heads trained on
    the same rows and judged."""
    out = tmp_path / "study.json"
    cmd = [sys.executable, str(REPO / "bench" / "draft_feature_study.py"), "--device", "cpu", "--num-texts", "4",
           "--num-eval-texts", "2", "--max-tokens", "48", "--epochs", "1", "--steps", "2", "--output", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=190)
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["layers"] == [2, 15, 27] and result["training_positions"] > 0
    for kind in ("recurrent", "layer_features"):
        for judged in (result["heads"][kind]["held_out"], result["heads"][kind]["bench_chat"]):
            assert len(judged["agreement"]) == 2 and 0 <= judged["walk_accepted"] <= 2
