"""Plant known drafter bugs in a scratch copy of the repository and check each drafter family's
reference test fails (``scripts/mutate_heads.py``'s machinery, with the drafters' own plants).

Exact verification keeps the trunk's tokens whatever a drafter proposes, so only the drafter's
reference test (mtplx == mlx-vlm 0.7.10 == the float64 oracle) can catch a wrong drafter. Per
family, one at a time: the wrong target layer, the mask token or position offset (DFlash), ``d2t``
off by one (EAGLE-3), a dropped norm, and more of the family's own; ``eagle3_cycle`` plants them
in EAGLE-3's drafting path in the cycle (`spec_decode/eagle3_proposer.py`: also a tap paired with
the wrong token, the rope position, the chain not rolled back) against its in-cycle reference
test. The last run's table is in ``tests/drafters/README.md``.

    python scripts/mutate_drafters.py [--families dflash]

Prints family x mutation -> caught / MISSED / error; exit status 1 unless every plant is caught.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutate_heads import Plant, check_family, scratch_copy  # noqa: E402

_LAYOUTS = "mtplx/drafters/layouts.py"
_DFLASH = "mtplx/drafters/dflash.py"
_EAGLE3 = "mtplx/drafters/eagle3.py"
_DSPARK = "mtplx/drafters/dspark.py"
_DFLASH2 = "mtplx/drafters/dflash2.py"
_EAGLE3_CYCLE = "mtplx/spec_decode/eagle3_proposer.py"

PLANTS_DFLASH: tuple[Plant, ...] = (
    Plant(
        "causal",
        "dflash_config.causal ignored (the block always bidirectional)",
        ((_DFLASH, 'mask = "causal" if self.is_causal else None', "mask = None"),),
    ),
    Plant(
        "wrong target layer",
        "target_layer_ids shifted by one",
        (
            (
                _LAYOUTS,
                "target_layer_ids=tuple(layer_ids),",
                "target_layer_ids=tuple(i + 1 for i in layer_ids),",
            ),
        ),
    ),
    Plant(
        "mask token",
        "mask_token_id + 1 in the block",
        (
            (
                _DFLASH,
                "self.spec.mask_token_id, dtype=mx.int32)",
                "self.spec.mask_token_id + 1, dtype=mx.int32)",
            ),
        ),
    ),
    Plant(
        "position offset",
        "the block one position early",
        (
            (
                _DFLASH,
                "start = cache.offset + new  #",
                "start = cache.offset + new - 1  #",
            ),
        ),
    ),
    Plant(
        "norm dropped",
        "hidden_norm of the context dropped",
        ((_DFLASH, "context = self.hidden_norm(self.fc(", "context = (self.fc("),),
    ),
    Plant(
        "norm dropped",
        "context keys normed by input_layernorm",
        (
            (
                _DFLASH,
                "h = h + self.self_attn(self.input_layernorm(h), context,",
                "h = h + self.self_attn(self.input_layernorm(h), self.input_layernorm(context),",
            ),
        ),
    ),
)

# The DFlash backbone's plants that DSpark (a DFlash backbone) must catch too.
_SHARED_WITH_DSPARK = (
    "target_layer_ids shifted by one",
    "mask_token_id + 1 in the block",
    "hidden_norm of the context dropped",
)

PLANTS: dict[str, tuple[Plant, ...]] = {
    "dflash": PLANTS_DFLASH,
    "eagle3": (
        Plant(
            "wrong target layer",
            "hidden_states index read as layer i - 2",
            (
                (
                    _LAYOUTS,
                    "return tuple(max(int(i) - 1, 0) for i in ids)",
                    "return tuple(max(int(i) - 2, 0) for i in ids)",
                ),
            ),
        ),
        Plant(
            "d2t off by one",
            "draft id i -> i + d2t[i] + 1",
            (
                (
                    _EAGLE3,
                    'return ids + self.d2t[ids] if "d2t" in self',
                    'return ids + self.d2t[ids] + 1 if "d2t" in self',
                ),
            ),
        ),
        Plant(
            "norm dropped",
            "hidden_norm of the first layer dropped",
            ((_EAGLE3, "normed = self.hidden_norm(h)", "normed = h"),),
        ),
        Plant(
            "norm dropped",
            "the embedding not normed by input_layernorm",
            (
                (
                    _EAGLE3,
                    "mx.concatenate([self.input_layernorm(embeds), normed]",
                    "mx.concatenate([embeds, normed]",
                ),
            ),
        ),
        Plant(
            "residual",
            "norm_before_residual read the other way",
            (
                (
                    _EAGLE3,
                    "residual = normed if self.norm_before_residual else h",
                    "residual = h if self.norm_before_residual else normed",
                ),
            ),
        ),
    ),
    # EAGLE-3 drafting in the cycle (`spec_decode.eagle3_proposer`): its drafts against mlx-vlm's
    # drafter rerun on each row's committed text.
    "eagle3_cycle": (
        Plant(
            "wrong target layer",
            "the trunk tapped one layer deeper",
            (
                (
                    _EAGLE3_CYCLE,
                    "return self.drafter.tapped_layers(len(trunk.layers))",
                    "return tuple(i + 1 for i in self.drafter.tapped_layers(len(trunk.layers)))",
                ),
            ),
        ),
        Plant(
            "d2t off by one",
            "q placed on the target vocabulary one id over",
            (
                (
                    _EAGLE3,
                    "out[..., self.draft_to_target(mx.arange(self.spec.draft_vocab_size))] = draft_logits",
                    "out[..., (self.draft_to_target(mx.arange(self.spec.draft_vocab_size)) + 1)"
                    " % self.spec.vocab_size] = draft_logits",
                ),
            ),
        ),
        Plant(
            "norm dropped",
            "the final norm before the draft LM head dropped",
            ((_EAGLE3, "normed = drafter.norm(hidden)", "normed = hidden"),),
        ),
        Plant(
            "pair offset",
            "each tap paired with its own token, not the next",
            ((_EAGLE3_CYCLE, "[row.history[-c:] + [0]", "[row.history[-c - 1 : -1] + [0]"),),
        ),
        Plant(
            "position offset",
            "a batch's pairs one rope position early",
            (
                (
                    _EAGLE3,
                    "h = layer(h, embeds, layer_cache, layer_cache.offset + 1, layer_cache.make_mask(length))",
                    "h = layer(h, embeds, layer_cache, layer_cache.offset, layer_cache.make_mask(length))",
                ),
            ),
        ),
        Plant(
            "no rollback",
            "the chain's K/V kept in the context",
            ((_EAGLE3_CYCLE, "            layer.set_lengths(committed)\n", "            pass\n"),),
        ),
    ),
    "dspark": (
        *(p for p in PLANTS_DFLASH if p.what in _SHARED_WITH_DSPARK),
        Plant(
            "previous token offset",
            "the Markov term by each draft's own token, not the one before",
            (
                (
                    _DSPARK,
                    "return mx.concatenate([anchor.reshape(-1, 1).astype(drafts.dtype), drafts[:, :-1]], axis=1)",
                    "return drafts",
                ),
            ),
        ),
    ),
    "dflash2": (
        *(p for p in PLANTS_DFLASH if p.what in _SHARED_WITH_DSPARK),
        Plant(
            "convolution",
            "the convolution not causal (the shift one position the other way)",
            ((_DFLASH2, "blocks[:, :-offset]], axis=1)", "blocks[:, offset:]], axis=1)"),),
        ),
        Plant(
            "selector",
            "the selector's edge by the draft's own candidate as predecessor",
            (
                (
                    _DFLASH2,
                    "selector.predecessor_codebook(previous)[:, :, None]",
                    "selector.predecessor_codebook(candidates)",
                ),
            ),
        ),
        Plant(
            "scale dropped",
            "input_embedding_scale dropped",
            ((_DFLASH2, " * embed_scale * drafter.dflash2.input_embedding_scale", " * embed_scale"),),
        ),
    ),
}

REFERENCE_TESTS: dict[str, tuple[str, ...]] = {
    "dflash": ("tests/drafters/test_dflash.py", "-k", "oracle"),
    "eagle3": ("tests/drafters/test_eagle3.py", "-k", "oracle"),
    "eagle3_cycle": ("tests/drafters/test_eagle3_drafting.py", "-k", "mlx_vlm"),
    "dspark": ("tests/drafters/test_dspark.py", "-k", "oracle"),
    "dflash2": ("tests/drafters/test_dflash2.py", "-k", "oracle"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(PLANTS), help="comma-separated (default: all)")
    families = [f.strip() for f in parser.parse_args(argv).families.split(",") if f.strip()]
    unknown = [f for f in families if f not in PLANTS]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(PLANTS)}")
    all_caught = True
    with tempfile.TemporaryDirectory(prefix="mtplx-drafter-mutants-") as tmp:
        root = scratch_copy(Path(tmp))
        for family in families:
            row = check_family(root, family, PLANTS, REFERENCE_TESTS)
            all_caught &= row[0] == "passes" and all(cell.startswith("caught") for cell in row[1:])
            print(f"| {family} | " + " | ".join(row) + " |", flush=True)
    return 0 if all_caught else 1


if __name__ == "__main__":
    sys.exit(main())
