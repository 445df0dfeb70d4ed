"""Block drafters drafting in the one cycle, for tests: tiny replicas loaded as the engine loads
them (`load_replica`), and many rows decoded together in one `BatchDecoder` (`decode_rows`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.spec_decode.block_proposer import BlockDrafter
from mtplx.spec_decode.loop import BatchDecoder
from mtplx.spec_decode.rows import RowSpec
from mtplx.spec_decode.sources import Source

import mlx.core as mx

from support import drafters

TARGET_LAYERS = 4
LAYER_IDS = [0, 2]


def load_replica(
    kind: Source,
    path: Path,
    vocab_size: int,
    seed: int = 3,
    sharpen: float = 1.0,
    layer_ids: Sequence[int] = LAYER_IDS,
    target_layers: int = TARGET_LAYERS,
) -> BlockDrafter:
    """A tiny ``kind`` drafter of a ``target_layers``-layer trunk tapping ``layer_ids``, written as
    published and loaded (float32); ``sharpen`` scales its final norm (DSpark: its Markov term),
    so its q are sharper (DSpark's far apart by position: a wrong-position q then shows)."""
    from mtplx.drafters.dflash import load_dflash
    from mtplx.drafters.dflash2 import load_dflash2
    from mtplx.drafters.dspark import load_dspark

    if kind is Source.EAGLE3:
        return load_eagle3_replica(path, vocab_size, seed, sharpen, target_layers=target_layers)
    make = {
        Source.DFLASH: (drafters.dflash_config, drafters.dflash_tensors, load_dflash),
        Source.DFLASH2: (drafters.dflash2_config, drafters.dflash2_tensors, load_dflash2),
        Source.DSPARK: (drafters.dspark_config, drafters.dspark_tensors, load_dspark),
    }[kind]
    config = make[0](vocab_size, list(layer_ids), target_layers)
    tensors = make[1](config, seed=seed)
    # DSpark's q differ by position through the Markov term (the token before each draft).
    sharpened = "markov_head.markov_w2.weight" if kind is Source.DSPARK else "norm.weight"
    tensors[sharpened] = tensors[sharpened] * sharpen
    drafter = make[2](drafters.write_dflash(path, config, tensors))
    drafter.set_dtype(mx.float32)
    return BlockDrafter(drafter, kind)


def eagle3_replica_config(vocab_size: int, target_layers: int = TARGET_LAYERS) -> dict:
    """The speculators layout over a draft vocabulary of a random 7/8 of the target's ids (so the
    target ids outside it come from the residual alone), tapping trunk layers 0, 1 and the last
    but one (Hugging Face ``hidden_states`` indices 1, 2, n - 1)."""
    return drafters.eagle3_config(vocab_size, vocab_size - max(vocab_size // 8, 1), [1, 2, target_layers - 1])


def load_eagle3_replica(
    path: Path, vocab_size: int, seed: int = 3, sharpen: float = 1.0, target_layers: int = TARGET_LAYERS
) -> BlockDrafter:
    """A tiny EAGLE-3 drafter (the speculators layout, a reduced draft vocabulary mapped by
    ``d2t``) of a ``target_layers``-layer trunk, written as published and loaded (float32);
    ``sharpen`` scales its final norm (sharper q)."""
    from mtplx.drafters.eagle3 import load_eagle3

    config = eagle3_replica_config(vocab_size, target_layers)
    tensors = drafters.eagle3_tensors(config, seed=seed)
    tensors["norm.weight"] = tensors["norm.weight"] * sharpen
    drafter = load_eagle3(drafters.write_eagle3(path, config, tensors))
    drafter.set_dtype(mx.float32)
    return BlockDrafter(drafter, Source.EAGLE3)


def decode_rows(
    trunk,
    prompts: Sequence[list[int]],
    specs: Sequence[RowSpec],
    n: int,
    *,
    seeds: Sequence[int] | None = None,
    head=None,
    blocks: BlockDrafter | None = None,
    constraints: Sequence | None = None,
    single_row: bool = False,
    on_decoder=None,
) -> tuple[list[list[int]], list[int]]:
    """Every prompt as one row of one decoder, stepped until each row has ``n`` tokens (or its
    grammar is done): (each row's first n tokens, each row's accepted drafts). ``on_decoder``
    sees the decoder before any row joins (a test counts its drafter's forwards)."""
    decoder = BatchDecoder(trunk, head, single_row=single_row, blocks=blocks)
    if on_decoder is not None:
        on_decoder(decoder)
    ids, tokens, accepted, done = [], {}, {}, set()
    for i, (prompt, spec) in enumerate(zip(prompts, specs)):
        key = mx.random.key(seeds[i] if seeds is not None else i)
        constraint = constraints[i] if constraints is not None else None
        row_id, step = decoder.join(prompt, spec, key, constraint=constraint)
        ids.append(row_id)
        tokens[row_id], accepted[row_id] = list(step.tokens), 0
    while True:
        live = [r for r in ids if len(tokens[r]) < n and r not in done]
        if not live:
            break
        for row_id, step in decoder.step().items():
            tokens[row_id] += step.tokens
            accepted[row_id] += step.num_accepted
            if step.grammar_done:
                done.add(row_id)
        present = {row.row_id for row in decoder.rows}
        decoder.leave([r for r in ids if (len(tokens[r]) >= n or r in done) and r in present])
    return [tokens[r][:n] for r in ids], [accepted[r] for r in ids]
