"""Speculative decoding in the executor: draft proposers and lossless verification.

    ngram.py        prompt lookup: drafts copied from the request's own tokens
    draft_model.py  a smaller model of the same tokenizer proposes k tokens
    draft_heads.py  Medusa-style heads on the target's last hidden state (and their files)
    heads_proposer.py  the heads as a proposer
    train_heads.py  self-distillation training of those heads
    verify.py       greedy and rejection-sampling verification of a chain of drafts
    proposer.py     the proposer interface the runner calls
"""
