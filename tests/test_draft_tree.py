"""Tree drafts: the tree's shape and masks, attention under tree masks, the verdict, the KV move, and
greedy tokens identical to plain decoding end to end (real SmolLM2 weights).

The oracles: attention of a tree row equals attention over exactly its
context and its ancestors (gathered by hand); a tree round's verdict equals a
walk down the tree by hand; the heads' best-guess path through a tree equals
the chain they draft; and greedy outputs equal those without speculation.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from executor_svc.speculative.draft_tree import (
    DEFAULT_TREE, DraftTree, TreeTensors, compact_kv, parse_tree, tree_round_inputs, tree_verdict,
    tree_verdict_sampled,
)
from executor_svc.speculative.proposer import SpeculativeConfig, SpeculativeMode
from plugins.attention_metadata import AttentionMetadata
from plugins.attention_torch import paged_attention, tree_visible
from tests.conftest import PROMPTS, TEST_DEVICE
from tests.test_speculative import COPY_PROMPTS, _generate

# -- the tree --------------------------------------------------------------------


def test_default_tree_is_breadth_first_and_prefixes_by_depth():
    tree = DraftTree(DEFAULT_TREE)
    assert tree.num_nodes == 14 and tree.depth == 4
    assert [tree.nodes_within(k) for k in range(1, tree.depth + 1)] == [3, 7, 11, 14]
    assert [len(p) for p in tree.paths] == sorted(len(p) for p in tree.paths)
    # Node 4 is (0, 0): its parent is node 1, (0,); node 12 is (0, 0, 0, 0).
    assert tree.paths[3] == (0, 0) and tree.parents[4] == 1
    assert tree.ancestors(12) == [1, 4, 8, 12]
    # Given out of order, the same tree.
    assert DraftTree(tuple(reversed(DEFAULT_TREE))).paths == tree.paths


def test_row_masks_show_each_node_its_ancestors_and_nothing_else_of_the_tree():
    tree = DraftTree(DEFAULT_TREE)
    masks = tree.row_masks(tree.num_nodes)
    assert masks[0] == -1  # the root row is a plain causal row
    context = 9  # tokens before the root's own position
    for j in range(1, tree.num_nodes + 1):
        lens = torch.tensor([context + j + 1])  # node j sits at sequence index context + j
        seen = tree_visible(torch.tensor([masks[j]]), lens, torch.arange(context + j + 1)[None])[0]
        expected = set(range(context + 1)) | {context + a for a in tree.ancestors(j)}
        assert set(torch.nonzero(seen).flatten().tolist()) == expected, j


@pytest.mark.parametrize("paths,message", [
    (((1,),), "best-guess path"),
    (((0,), (0, 0, 0)), "no parent"),
    (((0,), (0,)), "distinct"),
    (((0,), (0, 16)), "ranks"),
    (tuple((r,) for r in range(16)) + tuple((0, r) for r in range(16)) + tuple((1, r) for r in range(16))
     + tuple((2, r) for r in range(16)), "at most 63"),
])
def test_malformed_trees_are_refused(paths, message):
    with pytest.raises(ValueError, match=message):
        DraftTree(paths)


def test_tree_flag_parses_chain_default_and_paths():
    assert parse_tree("chain") is None and parse_tree("default") == DEFAULT_TREE
    assert parse_tree("0;1;0,0") == ((0,), (1,), (0, 0))
    with pytest.raises(ValueError, match="expected"):
        parse_tree("0;a")
    with pytest.raises(ValueError, match="draft_heads"):
        SpeculativeConfig(SpeculativeMode.NGRAM, 4, draft_tree=DEFAULT_TREE)


def test_draft_tree_flag_is_checked_before_anything_loads():
    import argparse

    from inflight.serving import speculative_config_from_args

    def config(speculative: str, tree: str, heads_lookup: int = 0, draft_heads: str | None = None,
               draft_vocab: int | None = None):
        args = argparse.Namespace(speculative=speculative, draft_tree=tree, num_draft_tokens=4, ngram_min=2,
                                  ngram_max=4, speculative_rounds=8, draft_model=None, heads_lookup=heads_lookup,
                                  draft_heads=draft_heads, draft_vocab=draft_vocab)
        return speculative_config_from_args(args)

    assert str(config("draft_heads", "chain", draft_heads="heads").draft_heads_dir) == "heads"
    with pytest.raises(SystemExit, match="a draft heads folder needs speculative mode draft_heads"):
        config("ngram", "chain", draft_heads="heads")

    assert config("draft_heads", "default").draft_tree == DEFAULT_TREE
    assert config("ngram", "chain").draft_tree is None
    with pytest.raises(SystemExit, match="needs --speculative draft_heads"):
        config("ngram", "default")
    with pytest.raises(SystemExit, match="no parent"):
        config("draft_heads", "0;0,0,0")
    assert config("draft_heads", "chain", heads_lookup=2).heads_lookup == 2
    with pytest.raises(SystemExit, match="heads_lookup drafts chains: it does not combine with a draft tree"):
        config("draft_heads", "default", heads_lookup=2)
    assert config("draft_heads", "chain", draft_vocab=0).draft_vocab == 0
    with pytest.raises(SystemExit, match="draft_vocab needs speculative mode draft_heads, not ngram"):
        config("ngram", "chain", draft_vocab=8192)
    with pytest.raises(SystemExit, match=r"draft_vocab must be at least 0 \(0 = every token\), got -1"):
        config("draft_heads", "chain", draft_vocab=-1)


# -- attention under tree masks ----------------------------------------------------------


def _tree_attention_step(tree: DraftTree, k: int, contexts: list[int], tokens_per_block: int = 4, seed: int = 0,
                         heads: int = 4, kv_heads: int = 2, head_dim: int = 16, dtype=torch.float32):
    """q, caches and metadata of one tree round for requests holding ``contexts`` tokens each."""
    gen = torch.Generator().manual_seed(seed)
    t = TreeTensors(tree, k, torch.device(TEST_DEVICE))
    rows_per = 1 + t.num_nodes
    blocks_each = -(-(max(contexts) + rows_per) // tokens_per_block)
    num_blocks = blocks_each * len(contexts) + 3
    shape = (num_blocks, tokens_per_block, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(TEST_DEVICE, dtype)
    v_cache = torch.randn(shape, generator=gen).to(TEST_DEVICE, dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.tensor([[free.pop() for _ in range(blocks_each)] for _ in contexts], device=TEST_DEVICE)
    lens = torch.tensor(contexts, device=TEST_DEVICE) + 1  # + the root token
    last = torch.zeros(len(contexts), dtype=torch.int64, device=TEST_DEVICE)
    nodes = torch.zeros((len(contexts), t.num_nodes), dtype=torch.int64, device=TEST_DEVICE)
    _, _, _, context, masks = tree_round_inputs(last, lens, nodes, tables, t, tokens_per_block)
    rows = len(contexts) * rows_per
    index = torch.arange(rows, device=TEST_DEVICE)
    meta = AttentionMetadata(
        query_start=list(range(rows + 1)), context_lens=context.flatten().tolist(),
        block_tables=tables.repeat_interleave(rows_per, dim=0), context_lens_t=context.flatten(),
        slot_mapping=index, single_query_rows=index, single_query_tokens=index, multi_query_rows=[],
        tree_masks=masks.flatten(),
    )
    q = torch.randn(rows, heads, head_dim, generator=gen).to(TEST_DEVICE, dtype)
    return q, k_cache, v_cache, meta, t


def _by_hand(q, k_cache, v_cache, meta, tree: DraftTree, rows_per: int, scale: float) -> torch.Tensor:
    """Each row's attention over exactly its visible keys: the context, then its ancestors and itself."""
    out = torch.empty_like(q)
    tokens_per_block = k_cache.shape[1]
    for row in range(q.shape[0]):
        node = row % rows_per
        end = int(meta.context_lens_t[row])
        base = end - 1 - node  # the root's sequence index
        keys = list(range(base + 1)) + [base + a for a in tree.ancestors(node)]
        table = meta.block_tables[row]
        blocks = table[torch.tensor(keys, device=q.device) // tokens_per_block]
        offsets = torch.tensor(keys, device=q.device) % tokens_per_block
        k = k_cache[blocks, offsets].float().transpose(0, 1)  # [kv_heads, keys, D]
        v = v_cache[blocks, offsets].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(q[row].float()[:, None], k, v, scale=scale, enable_gqa=True)
        out[row] = o[:, 0].to(q.dtype)
    return out


@pytest.mark.parametrize("k", [1, 3, 4])
def test_torch_attention_with_tree_masks_sees_exactly_each_rows_path(k):
    tree = DraftTree(DEFAULT_TREE)
    q, kc, vc, meta, t = _tree_attention_step(tree, k, [0, 5, 37])
    expected = _by_hand(q, kc, vc, meta, tree, 1 + t.num_nodes, 0.25)
    torch.testing.assert_close(paged_attention(q, kc, vc, meta, 0.25), expected, atol=2e-5, rtol=2e-5)


def test_triton_decode_attention_with_tree_masks_matches_the_torch_reference():
    pytest.importorskip("triton")
    from plugins.attention_triton_decode import DecodeTiles, decode_attention

    tree = DraftTree(DEFAULT_TREE)
    # Contexts around a split boundary, splits of 16 keys: some tiles hold only keys a row's mask hides.
    q, kc, vc, meta, t = _tree_attention_step(tree, 4, [0, 14, 40], tokens_per_block=16)
    expected = paged_attention(q, kc, vc, meta, 0.25)
    for tiles in (DecodeTiles(block_n=16, num_warps=4, num_stages=1),
                  DecodeTiles(block_n=16, num_warps=4, num_stages=1, programs_per_sm=64, min_split_tokens=16)):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, kc, vc, meta, 0.25, 0, out, tiles, num_sms=4)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


# -- verdict and KV move -------------------------------------------------------------------


def test_verdict_follows_the_deepest_path_the_target_agrees_with():
    tree = DraftTree(((0,), (1,), (0, 0), (1, 0), (1, 1), (0, 0, 0), (1, 0, 0)))
    # Nodes (breadth-first): 1=(0,) 2=(1,) 3=(0,0) 4=(1,0) 5=(1,1) 6=(0,0,0) 7=(1,0,0), holding tokens 7..13.
    t = TreeTensors(tree, 3, torch.device("cpu"))
    ids = torch.tensor([[50, 7, 8, 9, 10, 11, 12, 13]] * 3)
    target = torch.full_like(ids, 77)
    target[0, 0], target[0, 2], target[0, 5] = 8, 11, 30  # node 2 (8), then node 5 (11), then 30 of its own
    target[1, 0], target[1, 2], target[1, 4], target[1, 7] = 8, 10, 13, 31  # nodes 2, 4, 7: the whole depth
    target[2, 0] = 99  # no node after the root
    tokens, accepted, best = tree_verdict(ids, target, t)
    assert accepted.tolist() == [2, 3, 0] and best.tolist() == [5, 7, 0]
    assert tokens[0, :3].tolist() == [8, 11, 30]
    assert tokens[1].tolist() == [8, 10, 13, 31]
    assert tokens[2, 0].item() == 99


def test_children_list_each_nodes_guesses_best_first_within_the_depth():
    tree = DraftTree(((0,), (1,), (0, 0), (1, 0), (1, 1), (0, 0, 0), (1, 0, 0)))
    assert TreeTensors(tree, 3, torch.device("cpu")).children.tolist() == [
        [1, 2], [3, -1], [4, 5], [6, -1], [7, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert TreeTensors(tree, 1, torch.device("cpu")).children.tolist() == [[1, 2], [-1, -1], [-1, -1]]


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampled_tree_verdict_emits_the_target_distribution_at_every_depth(top_k):
    """Many requests judge the same tree: the first token follows the root's distribution; after an
    accepted node, the next token follows that node's; a token is emitted as a draft exactly when its node
    was accepted. (Nodes: 1=(0,) 2=(1,) 3=(2,) 4=(0,0) 5=(1,0) 6=(0,0,0); vocabulary of 6.)"""
    from scipy import stats as scipy_stats

    from executor_svc.sampler import RequestSamplingState
    from protos.plan import SamplingConfig

    torch.manual_seed(1)
    vocab, trials = 6, 8000
    tree = DraftTree(((0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)))
    t = TreeTensors(tree, 3, torch.device("cpu"))
    row_logits = torch.randn(7, vocab) * 1.5
    order = row_logits[0].argsort(descending=True).tolist()
    # The root's children: its second and first choices and its least likely token; then one guess each.
    node_ids = [0, order[1], order[0], order[-1], int(row_logits[1].argmax()), int(row_logits[2].argmax()),
                int(row_logits[4].argsort()[-2])]
    config = SamplingConfig(temperature=0.9, top_k=top_k)
    states = [RequestSamplingState(dataclasses.replace(config, seed=i), [1], "cpu") for i in range(trials)]
    ids = torch.tensor([node_ids] * trials)
    tokens, accepted, best = tree_verdict_sampled(ids, row_logits.repeat(trials, 1, 1), t, states)

    def target(row: int) -> torch.Tensor:
        scaled = row_logits[row] / config.temperature
        if top_k:
            scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], float("-inf"))
        return scaled.softmax(-1)

    def check(observed: torch.Tensor, probs: torch.Tensor) -> None:
        counts = torch.bincount(observed, minlength=vocab).double()
        keep = probs > 0
        assert counts[~keep].sum() == 0, "a token outside the filtered distribution was emitted"
        expected = probs[keep].double() * len(observed)
        chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
        assert chi2 < scipy_stats.chi2.ppf(0.999, int(keep.sum()) - 1), (counts, expected)

    check(tokens[:, 0], target(0))
    for node, parent_token in ((1, node_ids[1]), (2, node_ids[2])):  # below an accepted depth-1 node
        below = (best != 0) & (tokens[:, 0] == parent_token)
        assert int(below.sum()) > 500
        check(tokens[below, 1], target(node))
    deep = (tokens[:, 0] == node_ids[1]) & (tokens[:, 1] == node_ids[4])  # nodes 1 and 4 accepted
    assert int(deep.sum()) > 100
    check(tokens[deep, 2], target(4))
    # A draft's token is emitted exactly when its node is on the accepted path.
    first_child = {node_ids[1]: 1, node_ids[2]: 2, node_ids[3]: 3}
    for row in range(trials):
        a, b = int(accepted[row]), int(best[row])
        path = tree.ancestors(b)
        assert len(path) == a and tokens[row, :a].tolist() == [node_ids[j] for j in path]
        if a == 0:
            assert int(tokens[row, 0]) not in first_child


def test_compact_kv_moves_the_accepted_path_where_a_chain_would_have_written_it():
    tree = DraftTree(DEFAULT_TREE)
    t = TreeTensors(tree, 4, torch.device("cpu"))
    tokens_per_block, lens = 4, torch.tensor([6, 3])
    tables = torch.tensor([[3, 0, 5, 7, 1], [2, 4, 6, 8, 9]])
    cache = torch.randn(2, 2, 10, tokens_per_block, 1, 2)  # [layers, 2, blocks, tokens, kv_heads, D]
    before = cache.clone()
    best = torch.tensor([13, 6])  # (0, 0, 0, 1) at depth 4; (2, 0) at depth 2
    accepted = torch.tensor([4, 2])

    def at(c, b, seq):
        return c[:, :, tables[b, seq // tokens_per_block], seq % tokens_per_block]

    compact_kv(cache, lens, best, accepted, tables, t, tokens_per_block)
    for b in range(2):
        base = int(lens[b]) - 1
        path = tree.ancestors(int(best[b]))
        for depth, node in enumerate(path, start=1):
            assert torch.equal(at(cache, b, base + depth), at(before, b, base + node))
        for seq in range(base + 1):  # the context is untouched
            assert torch.equal(at(cache, b, seq), at(before, b, seq))


def test_move_kv_kernel_matches_compact_kv():
    pytest.importorskip("triton")
    from executor_svc.speculative.tree_triton import move_kv

    tree = DraftTree(DEFAULT_TREE)
    gen = torch.Generator().manual_seed(3)
    for k in (2, 4):
        t = TreeTensors(tree, k, torch.device(TEST_DEVICE))
        lens = torch.tensor([6, 3, 17, 40], device=TEST_DEVICE)
        tables = torch.randperm(32, generator=gen).view(4, 8).to(TEST_DEVICE)
        best = torch.tensor([tree.paths.index((0,) * k) + 1, 0, 6, t.num_nodes], device=TEST_DEVICE)
        accepted = torch.tensor([tree.depths[int(b)] for b in best.tolist()], device=TEST_DEVICE)
        cache = torch.randn(2, 2, 32, 8, 3, 4, generator=gen).to(TEST_DEVICE)  # kv_heads * D = 12: a padded row
        expected = cache.clone()
        compact_kv(expected, lens, best, accepted, tables, t, 8)
        move_kv(cache, lens, best, accepted, tables, t.paths, 8)
        assert torch.equal(cache, expected)


@pytest.mark.parametrize("width", [2, 3, 4])
def test_top_guesses_kernel_matches_topk(width):
    pytest.importorskip("triton")
    from executor_svc.speculative.tree_triton import top_guesses

    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(5, 3000, generator=gen).to(TEST_DEVICE)  # chunks of 2048: the best may sit in either
    logits[1, 2500] = 50.0
    strided = torch.randn(5, 2, 3000, generator=gen).to(TEST_DEVICE)[:, 1]  # rows of a [N, heads, V] tensor
    for x in (logits, strided):
        assert torch.equal(top_guesses(x, width), x.topk(width, dim=-1).indices)
    tied = torch.zeros(2, 100, device=TEST_DEVICE)
    assert top_guesses(tied, width).tolist() == [list(range(width))] * 2  # ties go to the lowest id


# -- heads grow trees ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["recurrent", "medusa"])
def test_the_heads_best_guess_path_through_a_tree_is_their_chain(engine, kind):
    from executor_svc.speculative.draft_heads import make_heads

    torch.manual_seed(0)
    heads = make_heads(kind, 4, engine.model_config.hidden_size, engine.model_config.vocab_size)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(std=0.02)
    heads = heads.to(engine.device, engine.dtype)
    hidden = torch.randn(3, engine.model_config.hidden_size, device=engine.device, dtype=engine.dtype)
    last = torch.tensor([5, 17, 900], device=engine.device)
    tree = DraftTree(DEFAULT_TREE)
    for k in (1, 2, 4):
        t = TreeTensors(tree, k, engine.device)
        nodes = heads.propose_tree(hidden, engine.model, t, last)
        assert nodes.shape == (3, tree.nodes_within(k))
        zero_path = [tree.paths.index((0,) * d) for d in range(1, k + 1)]
        assert torch.equal(nodes[:, zero_path], heads.propose(hidden, engine.model, k, last))
        # Siblings are distinct guesses of one parent.
        depth1 = [i for i, p in enumerate(tree.paths) if len(p) == 1]
        assert all(len(set(row)) == len(depth1) for row in nodes[:, depth1].tolist())


# -- scheduling ----------------------------------------------------------------------------


def test_scheduler_counts_a_tree_rounds_rows_and_judges_its_depth():
    from protos.plan import RequestOutput, StepResult
    from tests.test_scheduler import make_scheduler
    from tests.test_speculative import plan_after_first_step

    def scheduler():
        return make_scheduler(max_draft_tokens=4, max_speculative_rounds=3, adaptive_draft_length=False,
                              max_batch_size=32, max_num_tokens=256, draft_tree_rows=(4, 8, 12, 15))

    s = scheduler()  # the default tree: rounds of 1 + its nodes of depth <= k
    plan = plan_after_first_step(s, "ab", [101, 102, 103, 104], max_tokens=100)
    # Two requests in a batch of 32: 16 rows each, so the whole tree (15); 3 rounds of 15 tokens, of
    # which the KV cache needs 2 * 5 + 15 slots: a round moves on by at most 5.
    assert [(c.num_rounds, c.num_scheduled_tokens, c.draft_token_ids) for c in plan.cached_requests] == [
        (3, 45, [101, 102, 103, 104])] * 2
    assert len(s.kv.block_table("a")) * s.config.tokens_per_block == 32 >= 7 + 2 * 5 + 15
    # The rounds accepted 4, 1 and 0 drafts: 5 + 2 + 1 = 8 tokens, every round judged at depth 4.
    outputs = [RequestOutput(rid, list(range(200, 208)), [], 5, round_accepted=[4, 1, 0], round_drafted=[4, 4, 4])
               for rid in "ab"]
    s.update(StepResult(plan.step_id, outputs))
    req = s.requests["a"]
    assert req.num_computed_tokens == 6 + 8 and (req.num_draft_tokens, req.num_accepted_draft_tokens) == (12, 5)
    assert s.drafts.by_position == [6, 6, 6, 6] and s.drafts.accepted_by_position == [4, 2, 2, 2]
    # Five requests: 6 rows each, so trees of depth 1 (4 rows), rounds of 4 tokens.
    plan = plan_after_first_step(scheduler(), "abcde", [101, 102], max_tokens=100)
    assert {(c.num_rounds, c.num_scheduled_tokens, tuple(c.draft_token_ids)) for c in plan.cached_requests} == {
        (3, 12, (101,))}
    # 25 tokens left to hold: 3 rounds of the whole tree fit (2 * 5 + 15 = 25), though they compute 45.
    plan = plan_after_first_step(scheduler(), "a", [101, 102, 103, 104], max_tokens=26)
    assert (plan.cached_requests[0].num_rounds, plan.cached_requests[0].num_scheduled_tokens) == (3, 45)


# -- end to end ----------------------------------------------------------------------------


def _with_tree_graphs(engine):
    """``engine`` with graphs whose attention reads tree masks (on a GPU; the CPU has none)."""
    if engine.decode_graphs is None:
        return engine
    from executor_svc.engine import capture_graphs

    return dataclasses.replace(engine, decode_graphs=capture_graphs(engine, tree_masks=True))


@pytest.fixture(scope="module")
def tree_heads_dir(engine, tmp_path_factory):
    from executor_svc.speculative.draft_heads import RecurrentDraftHead, save_draft_heads

    torch.manual_seed(0)
    head = RecurrentDraftHead(4, engine.model_config.hidden_size, engine.model_config.vocab_size)
    with torch.no_grad():
        head.w_out.normal_(std=0.002)  # drifts a little: first guesses often right, runners-up sometimes
    folder = tmp_path_factory.mktemp("tree-heads")
    save_draft_heads(head, folder, {"test": True})
    return folder


def test_tree_drafts_give_the_same_greedy_tokens(engine, tokenizer, tree_heads_dir, monkeypatch):
    from executor_svc.speculative.tree_rounds import TreeRounds

    plain, _, _ = _generate(engine, tokenizer, COPY_PROMPTS + PROMPTS[:3])
    trees, real = [], TreeRounds.run

    def counting(self, requests, k, num_rounds, next_k, stops=None):
        trees.append((len(requests), k, num_rounds))
        return real(self, requests, k, num_rounds, next_k, stops)

    monkeypatch.setattr(TreeRounds, "run", counting)
    speculative = SpeculativeConfig(SpeculativeMode.DRAFT_HEADS, 4, max_rounds=3, draft_tree=DEFAULT_TREE)
    spec = dataclasses.replace(_with_tree_graphs(engine), engine_dir=tree_heads_dir, speculative=speculative)
    outputs, usages, stats = _generate(spec, tokenizer, COPY_PROMPTS + PROMPTS[:3], {"adaptive_draft_length": False})
    assert outputs == plain
    # Six requests in a batch of 64: rounds of 1 + 7 rows (depth 2) fit, 1 + 11 (depth 3) do not (the last ones
    # to finish chain deeper trees). Three rounds run to the end of the 20 output tokens, past it if need be.
    six = [k for n, k, _ in trees if n == 6]
    assert six and max(six) == 2 and max(r for _, _, r in trees) == 3
    assert stats.drafts.num_accepted == sum(u.num_accepted_draft_tokens for u in usages) > 0
    assert len(stats.drafts.by_position) == 4  # no deeper than the tree
    # One request: the whole tree, in rounds of 15 rows.
    trees.clear()
    alone, _, _ = _generate(spec, tokenizer, PROMPTS[:1], {"adaptive_draft_length": False}, max_tokens=64)
    assert alone == _generate(engine, tokenizer, PROMPTS[:1], max_tokens=64)[0]
    assert trees and max(k for _, k, _ in trees) == 4 and max(r for _, _, r in trees) == 3


def test_sampled_requests_verify_trees_and_a_seed_repeats_their_tokens(engine, tokenizer, tree_heads_dir, monkeypatch):
    """Sampling requests (and a greedy one beside them) verify trees: the sampled verdict is lossless
    (``test_sampled_tree_verdict_emits_the_target_distribution_at_every_depth``); here it runs in the
    executor, accepts drafts, leaves the greedy request's tokens as they are without speculation, and the
    same seeds give the same tokens again."""
    from executor_svc.speculative.tree_rounds import TreeRounds

    greedy_plain, _, _ = _generate(engine, tokenizer, PROMPTS[:1], max_tokens=24)
    trees, real = [], TreeRounds.run

    def counting(self, requests, k, num_rounds, next_k, stops=None):
        trees.append(sum(not r.sampling.config.is_greedy for r in requests))
        return real(self, requests, k, num_rounds, next_k, stops)

    monkeypatch.setattr(TreeRounds, "run", counting)
    speculative = SpeculativeConfig(SpeculativeMode.DRAFT_HEADS, 4, max_rounds=3, draft_tree=DEFAULT_TREE)
    spec = dataclasses.replace(_with_tree_graphs(engine), engine_dir=tree_heads_dir, speculative=speculative)
    runs = []
    for _ in range(2):
        sampled, usages, _ = _generate(spec, tokenizer, COPY_PROMPTS, {"adaptive_draft_length": False},
                                       sampling={"temperature": 0.8, "seed": 5}, max_tokens=24)
        runs.append(sampled)
        assert all(len(ids) == 24 for ids in sampled)
        assert all(0 <= t < engine.model_config.vocab_size for ids in sampled for t in ids)
        assert sum(u.num_accepted_draft_tokens for u in usages) > 0
    assert runs[0] == runs[1]
    assert trees and max(trees) == len(COPY_PROMPTS)  # every request of those steps sampled, on a tree
    greedy, _, _ = _generate(spec, tokenizer, PROMPTS[:1], {"adaptive_draft_length": False}, max_tokens=24)
    assert greedy == greedy_plain


def test_executor_offers_tree_rows_and_rejects_rounds_of_other_sizes(engine, tree_heads_dir):
    from executor_svc.runner import ModelRunner
    from executor_svc.service import executor_info
    from protos.plan import CachedRequest, NewRequest, SamplingConfig, StepPlan

    speculative = SpeculativeConfig(SpeculativeMode.DRAFT_HEADS, 4, max_rounds=3, draft_tree=DEFAULT_TREE)
    runner = ModelRunner(dataclasses.replace(_with_tree_graphs(engine), engine_dir=tree_heads_dir, speculative=speculative))
    info = executor_info(runner)
    assert list(info.draft_tree_rows) == [4, 8, 12, 15] and info.max_draft_tokens == 4
    greedy = SamplingConfig(temperature=0.0)
    runner.execute(StepPlan(1, new_requests=[NewRequest("r", list(range(10, 30)), 20, 0, 20, list(range(8)), greedy)]))
    # 2 rounds of depth 2 need 2 * 8 tokens; 2 * (1 + 2) is a chain's count, not this tree's.
    result = runner.execute(StepPlan(2, cached_requests=[CachedRequest("r", 20, 6, [], [], 0, 2)]))
    assert "one of [4, 8, 12, 15]" in result.request_errors["r"]


def test_tree_drafts_refuse_sliding_window_models_and_one_round_steps(engine, tree_heads_dir):
    from executor_svc.runner import ModelRunner

    one_round = SpeculativeConfig(SpeculativeMode.DRAFT_HEADS, 4, max_rounds=1, draft_tree=DEFAULT_TREE)
    with pytest.raises(ValueError, match="chained rounds"):
        ModelRunner(dataclasses.replace(engine, engine_dir=tree_heads_dir, speculative=one_round))
    manifest = dataclasses.replace(engine.manifest, model=dataclasses.replace(engine.model_config, sliding_window=512))
    windowed = dataclasses.replace(engine, engine_dir=tree_heads_dir, manifest=manifest,
                                   speculative=dataclasses.replace(one_round, max_rounds=3))
    with pytest.raises(ValueError, match="sliding-window"):
        ModelRunner(windowed)


def test_tree_rounds_end_once_every_request_has_finished(engine, tree_heads_dir):
    """A step of tree rounds stops after the round that takes its request to its length limit, and reports the
    rounds that ran: the first tokens of the full step."""
    from executor_svc.runner import ModelRunner
    from executor_svc.speculative.round_stops import LOOKBEHIND
    from protos.plan import CachedRequest, NewRequest, SamplingConfig, StepPlan

    speculative = SpeculativeConfig(SpeculativeMode.DRAFT_HEADS, 4, max_rounds=5, draft_tree=DEFAULT_TREE)
    spec = dataclasses.replace(_with_tree_graphs(engine), engine_dir=tree_heads_dir, speculative=speculative)
    greedy, prompt = SamplingConfig(temperature=0.0), list(range(10, 30))

    def tree_step(max_num_tokens: int):
        runner = ModelRunner(spec)
        runner.execute(StepPlan(1, new_requests=[
            NewRequest("r", prompt, 20, 0, 20, list(range(8)), greedy, max_num_tokens=max_num_tokens),
        ]))
        result = runner.execute(StepPlan(2, cached_requests=[CachedRequest("r", 20, 5 * 8, [], [], 0, 5)]))
        assert not result.request_errors
        return result.outputs[0]

    full = tree_step(0)
    assert len(full.round_accepted) == 5
    ends = [sum(a + 1 for a in full.round_accepted[: r + 1]) for r in range(5)]
    limited = tree_step(len(prompt) + 1 + 2)  # two tokens after the first step's
    # On a GPU one more round runs: the host reads a round's flags while the device runs the next.
    ran = next(r + 1 for r in range(5) if ends[r] >= 2) + (LOOKBEHIND if torch.device(TEST_DEVICE).type == "cuda" else 0)
    assert len(limited.round_accepted) == ran < 5 and limited.token_ids == full.token_ids[: ends[ran - 1]]


def test_tree_rounds_end_when_the_scheduler_asks(engine, tree_heads_dir):
    """Asked to end before it starts, a step of tree rounds runs one round (two where the judge and the next
    tree are one CUDA graph), returns the first tokens of the full step, and drafts for the next step."""
    from executor_svc.runner import ModelRunner
    from protos.plan import CachedRequest, NewRequest, SamplingConfig, StepPlan

    speculative = SpeculativeConfig(SpeculativeMode.DRAFT_HEADS, 4, max_rounds=5, draft_tree=DEFAULT_TREE)
    spec = dataclasses.replace(_with_tree_graphs(engine), engine_dir=tree_heads_dir, speculative=speculative)
    greedy, prompt = SamplingConfig(temperature=0.0), list(range(10, 30))

    def tree_step(ask: bool):
        runner = ModelRunner(spec)
        runner.execute(StepPlan(1, new_requests=[NewRequest("r", prompt, 20, 0, 20, list(range(8)), greedy)]))
        if ask:
            runner.end_rounds(2)
        result = runner.execute(StepPlan(2, cached_requests=[CachedRequest("r", 20, 5 * 8, [], [], 4, 5)]))
        assert not result.request_errors
        return result.outputs[0]

    full, asked = tree_step(False), tree_step(True)
    ran = 2 if torch.device(TEST_DEVICE).type == "cuda" else 1
    ends = [sum(a + 1 for a in full.round_accepted[: r + 1]) for r in range(5)]
    assert len(full.round_accepted) == 5 and asked.round_accepted == full.round_accepted[:ran]
    assert asked.token_ids == full.token_ids[: ends[ran - 1]]
    assert len(asked.next_draft_token_ids) == 4 == len(full.next_draft_token_ids)
