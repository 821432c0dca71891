"""bench/draft_attention_study.py: its all-chains-at-once attention draft is the chain serving would run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from draft_attention_study import AttentionDraft, draft_rights  # noqa: E402

HIDDEN, VOCAB = 32, 50
CONFIG = SimpleNamespace(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                         rope_theta=10000.0)


class TinyTarget(nn.Module):
    """The two parts of a target the draft reads: its token embedding and its LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def trained_looking_draft() -> AttentionDraft:
    torch.manual_seed(0)
    draft = AttentionDraft(CONFIG).double()
    with torch.no_grad():  # away from the identity start, so that every branch of the layer matters
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return draft


def served_chain(draft: AttentionDraft, states, embeddings, start: int, steps: int, feed=None) -> list[torch.Tensor]:
    """One chain as serving would run it, a step at a time: step 1 at row ``start`` attends to the true inputs' keys
    up to it; each later step feeds the previous step's output and attends to those keys and its own chain's.
    ``feed(step_output) -> embedding`` chooses the next step's token (default: the row's own embedding)."""
    length = states.shape[0]
    cos, sin = draft._rope_tables(length)
    true_x = draft.fc(torch.cat([states, embeddings], -1))
    q, k, v = draft._project(true_x, cos, sin)
    keys, values = [k[:, r] for r in range(start + 1)], [v[:, r] for r in range(start + 1)]

    def attend(query):
        scores = (query[:, None, :] * torch.stack(keys, 1)).sum(-1) * draft.dim**-0.5
        return (torch.softmax(scores, -1)[..., None] * torch.stack(values, 1)).sum(1)

    out = draft._finish(true_x[start : start + 1], attend(q[:, start])[:, None, :])[0]
    outputs = [out]
    for j in range(2, steps + 1):
        row = start + j - 1
        if row >= length:
            break
        embedding = embeddings[row] if feed is None else feed(out)
        x = draft.fc(torch.cat([out, embedding], -1))[None]
        q_j, k_j, v_j = draft._project(x, cos[row : row + 1], sin[row : row + 1])
        keys.append(k_j[:, 0])
        values.append(v_j[:, 0])
        out = draft._finish(x, attend(q_j[:, 0])[:, None, :])[0]
        outputs.append(out)
    return outputs


def test_all_chains_at_once_equal_chains_run_a_step_at_a_time() -> None:
    draft = trained_looking_draft()
    torch.manual_seed(1)
    length, steps = 12, 4
    states = torch.randn(length, HIDDEN, dtype=torch.float64)
    embeddings = torch.randn(length, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        batched = draft.chain(states, embeddings, steps)
        for start in range(length):
            for j, out in enumerate(served_chain(draft, states, embeddings, start, steps), start=1):
                torch.testing.assert_close(batched[j - 1][start + j - 1], out, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("own_tokens", [False, True], ids=["argmax_fed", "text_fed_from_row_3"])
def test_draft_rights_judge_each_chain_by_the_targets_argmax(own_tokens: bool) -> None:
    """Row t, column i of ``draft_rights`` is whether the chain begun at position t, fed the target's argmax there
    (or the text's own token) and then its own drafts, names the target's argmax at t + 1 + i (the check greedy
    verification makes); with a first row, the rows before it begin no chain."""
    draft = trained_looking_draft().float()
    torch.manual_seed(2)
    target = TinyTarget()
    length, steps = 10, 3
    hidden = torch.randn(length, HIDDEN)
    with torch.no_grad():  # two tokens lead everywhere, so that drafts are right about half the time
        target.lm_head.bias.zero_()
        target.lm_head.bias[:2] = 20.0
    greedy = target.compute_logits(hidden).argmax(-1)
    tokens, first = (torch.randint(0, 2, (length,)), 3) if own_tokens else (None, 0)
    right = draft_rights(draft, target, hidden, steps, tokens, first)
    assert right.shape == (length - 1 - first, steps)
    with torch.no_grad():
        fed = greedy[:-1] if tokens is None else tokens[1:]
        states, embeddings = hidden[:-1], target.embed_tokens(fed)
        seen = set()
        for start in range(first, length - 1):
            chain = served_chain(draft, states, embeddings, start, steps)
            for i, out in enumerate(chain):
                named = int(target.compute_logits(out[None]).argmax(-1))
                assert bool(right[start - first, i]) == (named == int(greedy[start + 1 + i])), (start, i)
                seen.add(bool(right[start - first, i]))
            assert not right[start - first, len(chain):].any()  # drafts past the text's end are never right
    assert seen == {True, False}


@pytest.mark.timeout(200)
def test_draft_attention_study_smoke(tmp_path: Path) -> None:
    """The study end to end on SmolLM2: a few short answers, both drafts trained on them and judged, the attention
    draft reading each answer's request too."""
    out = tmp_path / "study.json"
    cmd = [sys.executable, str(REPO / "bench" / "draft_attention_study.py"), "--device", "cpu", "--num-texts", "4",
           "--num-eval-texts", "2", "--max-tokens", "48", "--epochs", "1", "--steps", "2", "--with-prompt",
           "--output", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=190)
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["settings"]["with_prompt"] and result["training_positions"] > 0
    for kind in ("attention", "recurrent"):
        for judged in (result[kind]["held_out"], result[kind]["bench_chat"]):
            assert len(judged["agreement"]) == 2 and 0 <= judged["walk_accepted"] <= 2
