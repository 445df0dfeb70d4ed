"""How an `Engine` is built from files (`EngineLoading`, `Engine`'s base): the model through
`mtplx.checkpoints.load`, its vision tower, the head (`mtplx.heads.discovery.find_head`), a block
drafter or a draft model, `mtplx tune`'s saved depth and threshold, KV quantization, sharding,
and the prompt cache's disk tier. What an engine does with a request (plan, stream, batch) is
`mtplx.engine.engine`'s.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TypeVar

from mtplx.errors import MtplxError
from mtplx.heads.discovery import find_head
from mtplx.spec_decode.drafting import DEFAULT_ADAPTIVE_THRESHOLD, head_depth
from mtplx.trunk.kv_quant import KVQuantization, check_fit
from mtplx.trunk.vision import attach_declared

__all__ = ["KV_EXACTNESS_NOTE", "EngineLoading"]

_Loaded = TypeVar("_Loaded", bound="EngineLoading")


class EngineLoading:
    """`Engine`'s construction: ``Engine.load`` and what it attaches to the engine it builds
    (the attributes are `Engine.__init__`'s)."""

    @classmethod
    def load(
        cls: type[_Loaded],
        model: str | Path | None = None,
        *,
        head: str | Path | None = None,
        mtp: bool | None = None,
        depth: int | None = None,
        dtype: str | None = None,
        verify_backend: str = "auto",
        draft_model: str | Path | None = None,
        prompt_cache_bytes: int = 0,
        distributed: bool | str = False,
        collective_timeout: float | None = None,
        adapter_path: str | Path | None = None,
        kv_bits: int | None = None,
        kv_group_size: int | None = None,
        quantized_kv_start: int | None = None,
    ) -> _Loaded:
        """Load ``model`` (local path, Hugging Face repo id, or None for the embedded default).

        ``head`` is a forged-head directory or a Gemma 4 assistant (directory or cached repo id);
        without it the checkpoint's own MTP head is used, for a Gemma 4 target the
        ``<target>-assistant`` beside it or in the HF cache, or for the default model the head
        shipped with mtplx. ``mtp=False`` never loads a head; ``mtp=None`` loads one when there
        is one (a config that declares MTP layers whose tensors a converter stripped gets a
        one-line note on stderr and decodes AR); ``mtp=True`` makes a missing head an error.
        ``draft_model`` is a separate mlx-lm model with the same tokenizer (`draft="model"`).
        ``distributed`` ("pipeline" | "tensor" | True = auto) shards the trunk over the
        processes started by ``mlx.launch``; ``collective_timeout`` (seconds) bounds every
        wait on the other ranks (see mtplx/engine/distributed.py). ``adapter_path`` applies adapters
        trained with ``mlx_lm.lora``; the head keeps drafting and the output is the adapted
        model's, exactly. ``kv_bits`` / ``kv_group_size`` / ``quantized_kv_start``: mlx-lm's
        KV-cache quantization (`_quantize_kv`).
        """
        from mtplx.checkpoints import load as loading

        kv_plan = _kv_plan(kv_bits, kv_group_size, quantized_kv_start, distributed)  # before the load

        if dtype not in (None, *loading.VARIANTS):
            raise MtplxError(f"dtype must be one of {', '.join(loading.VARIANTS)} (got {dtype})")
        group = _launch_group(distributed, adapter_path) if distributed else None
        # Sharded: load lazily, so each rank only materializes the weights it keeps.
        loaded = loading.load_model(
            model, variant=dtype or "float32", lazy=bool(distributed), adapter_path=adapter_path
        )
        engine = cls(
            loaded.model,
            loaded.tokenizer,
            loaded.config,
            model_path=loaded.path,
            fingerprint=loaded.fingerprint,
            verify_backend=verify_backend,
            prompt_cache_bytes=prompt_cache_bytes,
        )
        engine.adapter_path = Path(adapter_path) if adapter_path is not None else None
        attach_declared(engine.trunk, loaded.path, loaded.config)  # a vision-language checkpoint's tower
        head, draft_model = engine._load_block_drafter(head, draft_model, mtp is not False, bool(distributed))
        if mtp is not False:  # mtp=False: plain AR; no head is looked for, so a misfit one cannot fail
            engine.head = find_head(
                loaded, engine.trunk, model=model, head=head, dtype=dtype, required=bool(mtp)
            )
        if depth is not None and depth < 1:
            raise MtplxError(f"depth must be >= 1 (got {depth})")
        engine.depth = depth if depth is not None else engine._default_depth()
        engine.adaptive_threshold = engine._tuned_threshold()
        if draft_model is not None:
            engine._load_draft_model(draft_model)
        if kv_plan is not None:
            engine._quantize_kv(kv_plan)
        if distributed:
            engine.distributed = _shard(engine, group, distributed, collective_timeout)
        return engine

    def _quantize_kv(self, plan: KVQuantization) -> None:
        """The trunk's KV cache quantized from ``plan.start`` on (mlx-lm's names and defaults: no
        bits, groups of 64, start 5000), at the same positions in speculative and plain decoding
        (mtplx/trunk/kv_quant.py). The MTP head's own cache stays float: one layer beside the
        trunk's many, rebuilt from true hidden states every cycle; its precision moves acceptance
        only, never the output."""
        check_fit(self.trunk, self.head, plan)
        self.trunk.kv_quantization = plan
        if self.trunk.vision is not None:
            self.trunk.vision.refuse_kv_bits()
        print(f"mtplx: note: {KV_EXACTNESS_NOTE}", file=sys.stderr)

    def use_disk_cache(self, directory: str | Path, max_bytes: int, kv: str = "") -> None:
        """Keep prompt-cache entries in ``directory`` too, up to ``max_bytes``, and reuse the ones
        there that this engine's model, adapters, dtype, head, block drafter and KV quantization
        (``kv``; by default the engine's ``--kv-bits`` plan) made (`mtplx.trunk.prompt_cache_disk`)."""
        from mtplx.trunk.prompt_cache_disk import DiskTier

        if self.distributed is not None:
            raise MtplxError("prompt cache dir: not supported on a sharded engine")
        if self.prompt_cache.max_bytes == 0:
            raise MtplxError("prompt cache dir: needs a prompt cache in RAM (prompt cache bytes > 0)")
        self.prompt_cache.disk = DiskTier(directory, max_bytes, self.cache_identity(kv))

    def cache_identity(self, kv: str = "") -> dict[str, str]:
        """What state this engine made must agree on to be reused by another (the disk tier's
        entries, the saved batch cost profile): `prompt_cache_disk.cache_identity` of its model,
        adapters, dtype, head, block drafter and KV quantization (``kv``; by default its
        ``--kv-bits`` plan)."""
        from mtplx.trunk.prompt_cache_disk import cache_identity

        plan = self.trunk.kv_quantization
        if not kv and plan is not None:
            kv = plan.label
        return cache_identity(
            fingerprint=self.fingerprint,
            trunk=self.trunk,
            head=self.head,
            adapter_path=self.adapter_path,
            kv=kv,
            drafter=self.block_drafter,
        )

    def _load_block_drafter(self, head, draft_model, search: bool, sharded: bool) -> tuple:
        """A DFlash / DFlash2 / DSpark / EAGLE-3 drafter named by ``head`` or ``draft_model`` (a
        directory; then it is neither), else (``search``, not ``sharded``) a fitting one beside the
        model, found by name then checked by config (`mtplx.drafters.discovery`); a named misfit
        is a one-line error naming the field, and so is one named for a sharded engine. Returns
        the (head, draft_model) still to load."""
        from mtplx.drafters import discovery
        from mtplx.spec_decode.block_proposer import BlockDrafter
        from mtplx.spec_decode.sources import Source

        named = [g for g in (head, draft_model) if discovery.read_block_drafter_config(g) is not None]
        model_path = Path(self.model_path or ".")
        found = discovery.find_block_drafter(model_path, named[0] if named else None, self.config)
        if found is None or (not named and not (search and not sharded and discovery.drafts(found))):
            return head, draft_model
        if sharded:
            raise MtplxError(f"{found.path}: block drafters are not supported on a sharded engine")
        drafter = discovery.load_block_drafter(found)  # a misfit: one line naming the field
        self.block_drafter = BlockDrafter(drafter, Source(found.layout))
        return (None if head in named else head), (None if draft_model in named else draft_model)

    def _load_draft_model(self, path: str | Path) -> None:
        """The separate mlx-lm model ``draft="model"`` drafts with, checked against the target
        (`draft_model_proposer.check_compatible`: tokenizer, the vocabulary both share); a block
        drafter's directory or a misfit is a one-line error."""
        from mtplx.checkpoints import load as loading
        from mtplx.drafters import discovery
        from mtplx.spec_decode.draft_model_proposer import check_compatible, embedding_rows

        block = discovery.find_block_drafter(Path(self.model_path or "."), path, self.config)
        if block is not None:  # a DFlash / DSpark / EAGLE-3 directory, not an mlx-lm model
            discovery.refuse_block_drafter(block)
        try:
            loaded = loading.load_model(path)
        except MtplxError as e:
            raise MtplxError(f"draft model: {e}") from None
        self.draft_vocab_size = check_compatible(
            self.tokenizer,
            loaded.tokenizer,
            embedding_rows(self.trunk.model),
            embedding_rows(loaded.model),
            str(path),
        )
        self.draft_model = loaded.model

    def _tuned_threshold(self) -> float:
        """`mtplx tune`'s adaptive-length threshold for this model here, else the built-in default."""
        from mtplx.engine import tuned

        saved = tuned.saved_threshold(self.fingerprint)
        return saved if saved is not None else DEFAULT_ADAPTIVE_THRESHOLD

    def _default_depth(self) -> int:
        """`mtplx tune`'s choice for this model on this machine (0 = AR was fastest), else the head's default."""
        from mtplx.engine import tuned

        saved = tuned.saved_depth(self.fingerprint)
        return saved if saved is not None else head_depth(self.head)


KV_EXACTNESS_NOTE = (
    "kv_bits: tokens equal plain decoding's only for one request decoded alone on a fresh cache; "
    "speculation, batched rows and prompt-cache reuse group positions into forwards differently, and "
    "rounding to a few bits can turn those float-level differences into other tokens (README: "
    "What is exact under --kv-bits)"
)


def _kv_plan(
    kv_bits: int | None, group_size: int | None, start: int | None, distributed: bool | str
) -> KVQuantization | None:
    """The validated KV quantization plan (None: float KV); refused on a sharded engine."""
    plan = KVQuantization.from_flags(kv_bits, group_size, start)
    if plan is not None and distributed:
        raise MtplxError("kv_bits: not supported when sharded")
    return plan


def _launch_group(distributed: bool | str, adapter_path) -> object:
    """The group of ranks a sharded engine runs over, checked before the (long) load: a process
    that runs alone, an unknown mode or adapters (merge them first) are refused."""
    from mtplx.engine import distributed as dist

    dist.parse_mode(distributed)
    if adapter_path is not None:
        raise MtplxError("adapter_path: not supported when sharded; merge the adapters first (mlx_lm.fuse)")
    return dist.launch_group()


def _shard(engine, group, mode: bool | str, collective_timeout: float | None):
    """The loaded engine's trunk sharded over ``group`` (`mtplx.engine.distributed`), every wait
    on the other ranks bounded by ``collective_timeout`` seconds (None: the default)."""
    from mtplx.engine import distributed as dist

    timeout = collective_timeout if collective_timeout is not None else dist.DEFAULT_COLLECTIVE_TIMEOUT
    return dist.shard_engine(engine, group, mode, timeout)
