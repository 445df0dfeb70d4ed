"""Memory of one MTP layer per precision group, from the shapes of published configs (no weights).

For each family: parameters per group (`mtplx.heads.precision.tensor_group`: projection,
attention, dense = shared experts + router, routed experts) from the config's dimensions, and the
bytes of one MTP layer at 8 bits everywhere, 4 bits everywhere and conversion's default beside a
4-bit trunk (routed experts 4, the rest 8). Affine quantization with group size 64 stores a
bfloat16 scale and bias per group: b/8 + 4/64 bytes per parameter. Norms, the router's bias and
the checkpoint's embedding / LM-head copies (identical to the trunk's, dropped at load) are left
out. Config values: DeepSeek-V3 / V3.1 (`deepseek-ai/DeepSeek-V3` config.json), GLM-4.5
(`zai-org/GLM-4.5`), Qwen3-Next-80B-A3B (`Qwen/Qwen3-Next-80B-A3B-Instruct`).

    python benchmarks/head_memory.py
"""

from __future__ import annotations

from mtplx.heads import precision

GROUP_SIZE = 64


def deepseek_v3() -> dict[str, int]:
    h, heads, q_lora, kv_lora, nope, rope, v = 7168, 128, 1536, 512, 128, 64, 128
    experts, inter, shared = 256, 2048, 1
    attention = (
        h * q_lora
        + q_lora * heads * (nope + rope)
        + h * (kv_lora + rope)
        + kv_lora * heads * (nope + v)
        + heads * v * h
    )
    return {
        "projection": 2 * h * h,
        "attention": attention,
        "dense": 3 * h * inter * shared + experts * h,
        "routed_experts": 3 * h * inter * experts,
    }


def glm4_5() -> dict[str, int]:
    h, heads, kv_heads, head_dim, experts, inter, shared = 5120, 96, 8, 128, 160, 1536, 1
    attention = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    return {
        "projection": 2 * h * h,
        "attention": attention,
        "dense": 3 * h * inter * shared + experts * h,
        "routed_experts": 3 * h * inter * experts,
    }


def qwen3_next_80b() -> dict[str, int]:
    h, heads, kv_heads, head_dim, experts, inter, shared_inter = 2048, 16, 2, 256, 512, 512, 512
    attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h  # gated q
    return {
        "projection": 2 * h * h,
        "attention": attention,
        "dense": 3 * h * shared_inter + experts * h + h,  # shared expert, router, shared-expert gate
        "routed_experts": 3 * h * inter * experts,
    }


def nbytes(params: dict[str, int], bits: dict[str, int]) -> float:
    return sum(n * (bits[g] / 8 + 4 / GROUP_SIZE) for g, n in params.items())


def main() -> None:
    print(
        "| family | parameters (projection / attention / dense / routed) | 8-bit | 4-bit | default beside a 4-bit trunk |"
    )
    print("|---|---|---|---|---|")
    for name, shapes in (
        ("DeepSeek-V3 / V3.1", deepseek_v3),
        ("GLM-4.5", glm4_5),
        ("Qwen3-Next-80B-A3B", qwen3_next_80b),
    ):
        params = shapes()
        default = {g: precision.default_bits(g, 4) for g in params}
        split = " / ".join(f"{params[g] / 1e6:.0f}M" for g in params)
        sizes = [nbytes(params, dict.fromkeys(params, 8)), nbytes(params, dict.fromkeys(params, 4))]
        sizes.append(nbytes(params, default))
        print(f"| {name} | {split} | " + " | ".join(f"{s / 1e9:.2f} GB" for s in sizes) + " |")


if __name__ == "__main__":
    main()
