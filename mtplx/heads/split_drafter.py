"""Split MTP drafters: a checkpoint's MTP layer published as its own directory, beside a stripped trunk.

The community's MLX trunks are made with mlx-lm's converter, which drops the MTP tensors; the
heads are published separately, as written by mlx-vlm's splitter (``python -m mlx_vlm.split_mtp``,
mlx-vlm 0.7.10 ``speculative/drafters/mtp_split.py``): a directory with ``config.json``
(``model_type`` ``<family>_mtp``, ``text_config`` = the source's whole text config,
``block_size`` = the pending token plus the drafts, optional ``quantization``) and
``model.safetensors`` holding only the head. Facts this module relies on (read in mlx-vlm
0.7.10's ``qwen3_5_mtp/{split,qwen3_5_mtp}.py``):

- the drafter shares the target's token embedding and LM head at run time (its ``bind``);
- ``qwen3_5_mtp`` tensors are named as mlx-lm's Qwen3.5 / Qwen3-Next head without ``mtp.``
  (``fc``, ``pre_fc_norm_{embedding,hidden}``, ``layers.{i}.*``, ``norm``), experts stacked;
- the splitter has already added 1 to the offset-style RMSNorm weights (its ``sanitize``), so
  the file holds plain scales: loaded as they are, never by the per-tensor mean guess;
- it reads the target's hidden state after the final norm (``Qwen3NextMTPHead``'s convention);
- its default ``block_size`` is ``mtp_num_hidden_layers + 2``: mtplx's default depth is
  ``block_size - 1``.

Finding one: beside the target directory (a sibling) or, for a repo id, in the Hugging Face
cache, by name (``drafter_rank``), then by config (``fit_problem``). A named drafter that does
not fit is a one-line error naming the mismatch, never a silent fallback.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import MTPHead
from mtplx.heads.weights import HeadSource, load_head_weights, weight_index


@dataclass(frozen=True)
class SplitFamily:
    """One split-drafter ``model_type``: the target text model types it serves and its builder
    (``build(src, num_layers) -> MTPHead``, unloaded, built beside ``src.trunk``)."""

    model_type: str
    target_types: tuple[str, ...]
    layers_key: str
    build: Any


def _qwen3_5_mtp(src: HeadSource, num_layers: int) -> MTPHead:
    from mtplx.heads import qwen3_next

    return qwen3_next.build_split_head(src, num_layers)


def _nemotron_h_mtp(src: HeadSource, num_layers: int) -> MTPHead:
    from mtplx.heads import nemotron_h

    return nemotron_h.build_split_head(src, num_layers)


def _glm_moe_dsa_mtp(src: HeadSource, num_layers: int) -> MTPHead:
    from mtplx.heads import deepseek

    return deepseek.build_split_head(src, deepseek.GLM_MOE_DSA_SPLIT)


def _glm4_moe_lite_mtp(src: HeadSource, num_layers: int) -> MTPHead:
    from mtplx.heads import deepseek

    return deepseek.build_split_head(src, deepseek.GLM4_MOE_LITE_SPLIT)


def _hy_v4_mtp(src: HeadSource, num_layers: int) -> MTPHead:
    from mtplx.heads import hy_v4

    return hy_v4.build_split_head(src, num_layers)


def _deepseek_v4_mtp(src: HeadSource, num_layers: int) -> MTPHead:
    from mtplx.heads import deepseek_v4

    return deepseek_v4.build_split_head(src, num_layers)


def _glm5_next_mtp(src: HeadSource, num_layers: int) -> MTPHead:
    from mtplx.heads import glm5_next

    return glm5_next.build_split_head(src, num_layers)


def _qwen4_exp_mtp(src: HeadSource, num_layers: int) -> MTPHead:
    from mtplx.heads import qwen4_exp

    return qwen4_exp.build_split_head(src, num_layers)


def _inkling_mtp(src: HeadSource, num_layers: int) -> MTPHead:
    from mtplx.heads import inkling

    return inkling.build_split_head(src, num_layers)


SPLIT_FAMILIES: dict[str, SplitFamily] = {
    f.model_type: f
    for f in (
        SplitFamily(
            model_type="qwen3_5_mtp",
            target_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"),
            layers_key="mtp_num_hidden_layers",
            build=_qwen3_5_mtp,
        ),
        SplitFamily(
            model_type="nemotron_h_mtp",
            target_types=("nemotron_h",),
            layers_key="num_nextn_predict_layers",
            build=_nemotron_h_mtp,
        ),
        # GLM-5 and GLM-4.7-Flash: one DeepSeek-layout module (mtplx.heads.deepseek.SplitNames).
        SplitFamily(
            model_type="glm_moe_dsa_mtp",
            target_types=("glm_moe_dsa",),
            layers_key="num_nextn_predict_layers",
            build=_glm_moe_dsa_mtp,
        ),
        SplitFamily(
            model_type="glm4_moe_lite_mtp",
            target_types=("glm4_moe_lite",),
            layers_key="num_nextn_predict_layers",
            build=_glm4_moe_lite_mtp,
        ),
        # Hunyuan-V4 (its trunk hosted through mlx-vlm): mtplx.heads.hy_v4.SPLIT_NAMES.
        SplitFamily(
            model_type="hy_v4_mtp",
            target_types=("hy_v4",),
            layers_key="num_nextn_predict_layers",
            build=_hy_v4_mtp,
        ),
        # DeepSeek-V4 (its trunk hosted through mlx-vlm): mtplx.heads.deepseek_v4.build_split_head.
        SplitFamily(
            model_type="deepseek_v4_mtp",
            target_types=("deepseek_v4",),
            layers_key="num_nextn_predict_layers",
            build=_deepseek_v4_mtp,
        ),
        # GLM-5-Next (its trunk hosted through mlx-vlm): mtplx.heads.glm5_next.build_split_head.
        SplitFamily(
            model_type="glm5_next_mtp",
            target_types=("glm5_next", "glm5_next_text"),
            layers_key="num_nextn_predict_layers",
            build=_glm5_next_mtp,
        ),
        # Qwen3.8-Flash-Next (its trunk hosted through mlx-vlm): mtplx.heads.qwen4_exp.build_split_head.
        SplitFamily(
            model_type="qwen4_exp_mtp",
            target_types=("qwen4_exp", "qwen4_exp_text"),
            layers_key="mtp_num_hidden_layers",
            build=_qwen4_exp_mtp,
        ),
        # Inkling (its trunk hosted through mlx-vlm): mtplx.heads.inkling.build_split_head.
        SplitFamily(
            model_type="inkling_mtp",
            target_types=("inkling",),
            layers_key="num_mtp_layers",
            build=_inkling_mtp,
        ),
    )
}

# The text-config fields a drafter must share with its target: the shapes its tensors and the
# shared embedding / LM head have, and the layer pattern the head's layer is modelled on.
FIT_KEYS = (
    "model_type",
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_hidden_layers",
    "layer_types",
    "full_attention_interval",
    "rms_norm_eps",
    # Nemotron-H (nemotron_h_mtp): its block pattern, norm epsilon and experts
    "hybrid_override_pattern",
    "mtp_hybrid_override_pattern",
    "layer_norm_epsilon",
    # MLA (the GLM drafters): latent ranks and head dimensions, routed experts
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "n_routed_experts",
)


def read_split_config(path: str | Path | None) -> dict | None:
    """The drafter's config when ``path`` holds a split drafter of a known family, else None."""
    if path is None:
        return None
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("model_type") not in SPLIT_FAMILIES:
        return None
    if not isinstance(config.get("text_config"), dict):
        raise MtplxError(f"{config_path}: a {config['model_type']} drafter config without a text_config")
    return config


def is_split_target(target_config: dict) -> bool:
    """A target some split-drafter family serves (by its model types)."""
    types = {str(c.get("model_type", "")) for c in (target_config, target_config.get("text_config") or {})}
    return any(types & set(f.target_types) for f in SPLIT_FAMILIES.values())


def _text(config: dict) -> dict:
    return config.get("text_config") or config


def fit_problem(drafter_config: dict, target_config: dict) -> str | None:
    """Why a drafter does not fit a target (the first field of ``FIT_KEYS`` whose value differs
    between the drafter's source ``text_config`` and the target's text config), or None.
    A field only one of them states is not compared (a source field a converter dropped)."""
    family = SPLIT_FAMILIES[drafter_config["model_type"]]
    target_text = _text(target_config)
    target_types = {str(target_config.get("model_type")), str(target_text.get("model_type"))}
    if not target_types & set(family.target_types):
        shown = "/".join(sorted(t for t in target_types if t and t != "None"))
        return f"a {family.model_type} drafter serves {', '.join(family.target_types)} targets, not {shown}"
    source = drafter_config["text_config"]
    for key in FIT_KEYS:
        if key in source and key in target_text and source[key] != target_text[key]:
            return f"{key} {source[key]!r}, the target's {target_text[key]!r}"
    return None


def default_depth(drafter_config: dict) -> int | None:
    """mtplx's depth for the drafter: ``block_size`` counts the pending token plus the drafts."""
    block = drafter_config.get("block_size")
    return int(block) - 1 if isinstance(block, int) and block >= 2 else None


def load_split_drafter(drafter_dir: str | Path, trunk: Any, target_config: dict) -> MTPHead:
    """The split drafter in ``drafter_dir`` as a draft head bound to ``trunk``'s embedding and LM
    head; a one-line MtplxError naming the mismatch when it does not fit the target."""
    drafter_dir = Path(drafter_dir)
    config_path = drafter_dir / "config.json"
    config = read_split_config(drafter_dir)
    if config is None:
        raise MtplxError(f"{config_path}: not a split MTP drafter (model_type {', '.join(SPLIT_FAMILIES)})")
    problem = fit_problem(config, target_config)
    if problem is not None:
        raise MtplxError(f"{config_path}: does not fit this model: {problem}")
    family = SPLIT_FAMILIES[config["model_type"]]
    num_layers = int(config["text_config"].get(family.layers_key) or 1)
    src = HeadSource(drafter_dir, config, weight_index(drafter_dir), trunk)
    head = family.build(src, num_layers)
    load_head_weights(head, src)
    head.default_depth = default_depth(config)
    return head


# --- finding the drafter of a target ------------------------------------------------------

# A trunk's precision suffix as the community names conversions (-4bit, -8bit-DWQ, -bf16, -mxfp4);
# an "-MLX" right before it is part of the publisher's naming, not of the model's.
_PRECISION = re.compile(
    r"(?i)-(\d+bit|bf16|fp16|fp32|f16|f32|bfloat16|float16|float32|mxfp4|mxfp8|nvfp4)([-_].*)?$"
)
_MLX = re.compile(r"(?i)-mlx$")
# Which of several fitting drafters wins: the precision the split keeps best first.
_SUFFIX_ORDER = ("bf16", "fp16", "f16", "8bit", "mxfp8", "6bit", "5bit", "4bit")


def target_stems(name: str) -> list[str]:
    """The model name a drafter of ``name`` (a trunk's directory or repo name) starts with:
    ``Qwen3.5-9B-4bit`` -> [``Qwen3.5-9B``, ``Qwen3.5-9B-4bit``]; ``Qwen3.5-9B-MLX-4bit`` -> [``Qwen3.5-9B-MLX``,
    ``Qwen3.5-9B``, ``Qwen3.5-9B-MLX-4bit``]: the name itself last (``<trunk>-MTP-8bit``)."""
    stem = _PRECISION.sub("", name)
    return list(dict.fromkeys([stem, _MLX.sub("", stem), name]))


def drafter_rank(candidate: str, target: str) -> tuple[int, str] | None:
    """Where ``candidate`` (a directory or repo name) ranks as the drafter of ``target``, and
    why; None when its name does not say so. ``<target>-mtp`` (mlx-vlm's converter) first, then
    ``<stem>-MTP-<precision>`` (the community's: the trunk's precision suffix replaced),
    bfloat16 before 8-bit before the rest."""
    low = candidate.lower()
    if low == f"{target}-mtp".lower():
        return 0, f"named <model>-mtp: mlx-vlm's own name for {target}'s drafter"
    for stem in target_stems(target):
        prefix = f"{stem}-mtp".lower()
        if low.startswith(prefix) and (len(low) == len(prefix) or low[len(prefix)] in "-_"):
            rest = low[len(prefix) + 1 :]
            order = next((i for i, s in enumerate(_SUFFIX_ORDER) if rest.startswith(s)), len(_SUFFIX_ORDER))
            return 1 + order, f"named {stem}-MTP-*: {target} with its precision suffix replaced"
    return None


@dataclass(frozen=True)
class Candidate:
    """A directory whose name says it is a target's drafter: where, why, and whether it fits."""

    name: str
    path: Path
    why: str
    config: dict
    problem: str | None


def _sibling_dirs(model_path: Path) -> list[tuple[str, Path]]:
    parent = Path(model_path).parent
    try:
        return [(p.name, p) for p in sorted(parent.iterdir()) if p.is_dir() and p != Path(model_path)]
    except OSError:
        return []


def _cached_repos(repo_id: str, hub_cache: str | Path | None) -> list[tuple[str, Path]]:
    """``(repo name, snapshot dir)`` of the model repos in the Hugging Face cache whose names say
    they are ``repo_id``'s drafter (``drafter_rank``), read offline; ``repo_id``'s owner first."""
    from huggingface_hub import constants, snapshot_download

    cache = Path(hub_cache or constants.HF_HUB_CACHE)
    owner, target = repo_id.split("/")[0], repo_id.split("/")[-1]
    try:
        repos = ["/".join(p.name.split("--")[1:]) for p in cache.iterdir() if p.name.startswith("models--")]
    except OSError:
        return []
    named = sorted(
        (r for r in repos if drafter_rank(r.split("/")[-1], target)),
        key=lambda r: (r.split("/")[0] != owner, r),
    )
    found: list[tuple[str, Path]] = []
    for repo in named:
        try:
            snap = Path(snapshot_download(repo, local_files_only=True, cache_dir=hub_cache))
        except Exception:  # incomplete or not a snapshot mtplx can read: not a candidate
            continue
        found.append((repo.split("/")[-1], snap))
    return found


def drafter_candidates(
    model_path: Path, spec: str | Path | None, target_config: dict, hub_cache: str | Path | None = None
) -> list[Candidate]:
    """Every split drafter named like the target's, best first: siblings of ``model_path``, then
    for a repo id ``spec`` the Hugging Face cache. Each is checked against ``target_config``."""
    from mtplx.model_files.hub import is_repo_id

    target = Path(model_path).name
    places = _sibling_dirs(model_path)
    if isinstance(spec, str) and not Path(spec).expanduser().exists() and is_repo_id(spec):
        target = spec.split("/")[-1]
        places += _cached_repos(spec, hub_cache)
    ranked: list[tuple[int, Candidate]] = []
    seen: set[Path] = set()
    for name, path in places:
        rank = drafter_rank(name, target)
        config = read_split_config(path) if rank is not None and path.resolve() not in seen else None
        if config is None:
            continue
        seen.add(path.resolve())
        problem = fit_problem(config, target_config)
        ranked.append((rank[0], Candidate(name, path, rank[1], config, problem)))
    return [c for _, c in sorted(ranked, key=lambda rc: rc[0])]


def find_split_drafter(
    model_path: Path, spec: str | Path | None, target_config: dict, hub_cache: str | Path | None = None
) -> Candidate | None:
    """The best fitting drafter beside the target (``drafter_candidates``); None when there is
    none; an MtplxError naming the mismatch when drafters are named like the target's but none fits."""
    if not is_split_target(target_config):
        return None
    candidates = drafter_candidates(model_path, spec, target_config, hub_cache)
    for c in candidates:
        if c.problem is None:
            return c
    if candidates:
        c = candidates[0]
        raise MtplxError(
            f"{c.path / 'config.json'}: a split MTP drafter {c.why}, but it does not fit this model: "
            f"{c.problem}; pass --head DIR or --no-mtp"
        )
    return None


def looked_for(model_path: Path, spec: str | Path | None) -> str:
    """The names a drafter of the target would have, for the note when none is found."""
    from mtplx.model_files.hub import is_repo_id

    is_repo = isinstance(spec, str) and not Path(spec).expanduser().exists() and is_repo_id(spec)
    target = spec.split("/")[-1] if is_repo else Path(model_path).name
    return f"{target_stems(target)[0]}-MTP-* or {target}-mtp"


# --- what `mtplx inspect` says --------------------------------------------------------------

SPLIT_NORMS_RULE = "plain scales: a split MTP drafter (mlx-vlm's splitter added 1)"


def describe_drafter(config: dict) -> str:
    """One line on what a split drafter is and how to use it (``mtplx inspect DRAFTER``)."""
    family = SPLIT_FAMILIES[config["model_type"]]
    text = config["text_config"]
    layers = int(text.get(family.layers_key) or 1)
    depth = default_depth(config)
    return (
        f"a split MTP drafter ({family.model_type}, {layers} layer(s), default depth {depth or '?'} from "
        f"block_size {config.get('block_size', '?')}) for {text.get('model_type')} targets with hidden_size "
        f"{text.get('hidden_size')} and vocab {text.get('vocab_size')}; it uses the target's embedding and "
        "LM head: pass it with --head, or put it beside the target as <model stem>-MTP-<precision>"
    )


def head_info(drafter_dir: Path, config: dict, source: str) -> dict:
    """The head facts ``inspect`` prints for a split drafter: layers, parameters (packed weights
    at their real width), bytes, default depth; ``split`` marks it for the norm-rule line."""
    from mtplx.model_files.headers import read_safetensors_header

    index = weight_index(drafter_dir)
    header: dict[str, dict] = {}
    for file in sorted(set(index.values())):
        header.update(read_safetensors_header(Path(drafter_dir) / file))
    bits = int((config.get("quantization") or {}).get("bits") or 32)
    params = 0
    for name, info in header.items():
        numel = 1
        for d in info["shape"]:
            numel *= d
        if name.endswith((".scales", ".biases")):
            continue
        packed = name.endswith(".weight") and f"{name[: -len('.weight')]}.scales" in header
        params += numel * 32 // bits if packed else numel
    family = SPLIT_FAMILIES[config["model_type"]]
    return {
        "source": source,
        "split": True,
        "dir": str(drafter_dir),
        "draft_vocab": "full",
        "layout": config["model_type"],
        "layers": int(config["text_config"].get(family.layers_key) or 1),
        "parameters": params,
        "bytes": sum(p.stat().st_size for p in Path(drafter_dir).glob("*.safetensors")),
        "default_depth": default_depth(config),
    }


def inspect_split(
    model_path: Path, spec: str | Path | None, target_config: dict, given: Path | None
) -> dict | None:
    """The split drafter a target would draft with and why (given with --head, else found by
    ``drafter_candidates``): name, path, why, problem (None: fits). ``path`` None when none is
    found (``looked_for`` names what would be). None for targets no split family serves."""
    if given is not None:
        config = read_split_config(given)
        return {"name": Path(given).name, "path": str(given), "why": "given with --head",
                "problem": fit_problem(config, target_config)}  # fmt: skip
    if not is_split_target(target_config):
        return None
    candidates = drafter_candidates(model_path, spec, target_config)
    best = next((c for c in candidates if c.problem is None), candidates[0] if candidates else None)
    if best is None:
        return {"name": None, "path": None, "looked_for": looked_for(model_path, spec), "problem": None}
    return {"name": best.name, "path": str(best.path), "why": best.why, "problem": best.problem}
