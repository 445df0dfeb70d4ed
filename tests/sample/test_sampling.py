"""The NumPy oracle (mtplx.sampling): exactness of the speculative math, the pipeline, validation."""

from __future__ import annotations

import math

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.errors import MtplxError
from mtplx.sample import reference as sampling  # the oracle module itself (mtplx.sampling re-exports it)
from mtplx.sample.reference import speculative_output_marginal as oracle_marginal
from mtplx.sampling import (
    SamplerConfig,
    SparseDistribution,
    acceptance_probability,
    apply_penalties,
    autoregressive_joint,
    chain_output_distribution,
    distribution_from_logits,
    residual_distribution,
    speculative_output_marginal,
)

import numpy as np
import pytest
from support.seeds import SEEDS, resolve


def random_config(rng: np.random.Generator, vocab_size: int) -> SamplerConfig:
    """A random pipeline: temperatures 0..2, each filter on or off, sometimes penalties."""
    return SamplerConfig(
        temperature=float(rng.choice([0.0, 0.3, 1.0, 2.0, rng.uniform(0.05, 2.0)])),
        top_k=int(rng.choice([0, 0, 1, 3, 7])),
        top_p=float(rng.choice([1.0, 1.0, 0.5, 0.9, rng.uniform(0.05, 1.0)])),
        min_p=float(rng.choice([0.0, 0.0, 0.05, 0.3])),
        repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])),
        presence_penalty=float(rng.choice([0.0, 0.5])),
        frequency_penalty=float(rng.choice([0.0, 0.2, -0.3])),
        logit_bias={int(rng.integers(0, vocab_size)): float(rng.normal())} if rng.random() < 0.3 else None,
    )


def random_distribution(rng: np.random.Generator, vocab_size: int) -> np.ndarray:
    """p over the vocabulary with a mix of shapes: filtered (zeros), one-hot, flat, peaked."""
    kind = rng.integers(0, 4)
    if kind == 0:
        p = np.zeros(vocab_size)
        p[rng.integers(vocab_size)] = 1.0
        return p
    logits = rng.normal(scale=rng.choice([0.5, 2.0, 6.0]), size=vocab_size)
    if kind == 1:
        logits[rng.random(vocab_size) < 0.4] = -np.inf  # hard zeros
        logits[rng.integers(vocab_size)] = 0.0  # keep at least one finite entry
    context = rng.integers(0, vocab_size, size=int(rng.integers(0, 6)))
    return distribution_from_logits(logits, random_config(rng, vocab_size), context_tokens=context)


# ----------------------------------------------------------------------------
# Exactness of one step and of a whole chain
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_marginal_equals_target_for_random_pairs(seed: int) -> None:
    seed = resolve(seed)
    rng = np.random.default_rng(seed)
    for trial in range(400):
        vocab_size = int(rng.choice([2, 5, 33]))
        p, q = random_distribution(rng, vocab_size), random_distribution(rng, vocab_size)
        marginal = speculative_output_marginal(p, q)
        assert np.max(np.abs(marginal - p)) < 1e-12, f"seed {seed} trial {trial}: p={p} q={q}"


def test_marginal_known_values_and_reexport() -> None:
    p = np.array([0.5, 0.5, 0.0])
    q = np.array([0.9, 0.1, 0.0])
    np.testing.assert_allclose(acceptance_probability(p, q), [5 / 9, 1.0, 0.0], rtol=0, atol=1e-15)
    np.testing.assert_allclose(residual_distribution(p, q), [0.0, 1.0, 0.0], rtol=0, atol=1e-15)
    # accept mass [0.5, 0.1, 0] + rejection mass 0.4 * residual [0, 1, 0]
    np.testing.assert_allclose(speculative_output_marginal(p, q), [0.5, 0.5, 0.0], rtol=0, atol=1e-15)
    assert oracle_marginal is speculative_output_marginal  # mtplx.sampling is the oracle's public face


def test_acceptance_is_zero_where_draft_never_proposes() -> None:
    np.testing.assert_array_equal(
        acceptance_probability(np.array([0.3, 0.7]), np.array([0.0, 1.0])), [0.0, 0.7]
    )


def test_residual_falls_back_to_target_on_zero_mass() -> None:
    p = np.array([0.2, 0.8])
    np.testing.assert_array_equal(residual_distribution(p, p.copy()), p)
    np.testing.assert_array_equal(residual_distribution(p, np.array([0.1, 0.9])), [1.0, 0.0])


def test_marginal_is_not_target_for_a_wrong_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the exactness check detects the classic bug (resampling from p)."""
    p, q = np.array([0.6, 0.3, 0.1]), np.array([0.1, 0.3, 0.6])
    monkeypatch.setattr(sampling, "residual_distribution", lambda target, draft: np.asarray(target))
    assert np.max(np.abs(sampling.speculative_output_marginal(p, q) - p)) > 0.1


@pytest.mark.parametrize("seed", SEEDS)
def test_sparse_forms_equal_dense_forms(seed: int) -> None:
    seed = resolve(seed)
    rng = np.random.default_rng(seed)
    for trial in range(300):
        vocab_size = int(rng.choice([3, 17, 64]))
        p, q = random_distribution(rng, vocab_size), random_distribution(rng, vocab_size)
        sparse_p, sparse_q = SparseDistribution.from_dense(p), SparseDistribution.from_dense(q)
        context = f"seed {seed} trial {trial}"
        np.testing.assert_allclose(
            acceptance_probability(sparse_p, sparse_q).to_dense(vocab_size),
            acceptance_probability(p, q),
            rtol=0,
            atol=1e-15,
            err_msg=context,
        )
        np.testing.assert_allclose(
            residual_distribution(sparse_p, sparse_q).to_dense(vocab_size),
            residual_distribution(p, q),
            rtol=0,
            atol=1e-15,
            err_msg=context,
        )
        np.testing.assert_allclose(
            speculative_output_marginal(sparse_p, sparse_q).to_dense(vocab_size),
            speculative_output_marginal(p, q),
            rtol=0,
            atol=1e-15,
            err_msg=context,
        )


def test_sparse_forms_never_touch_the_vocabulary() -> None:
    """Token ids near 10**15: any O(V) array would not fit in memory."""
    huge = 10**15
    p = SparseDistribution(np.array([3, huge - 5, huge]), np.array([0.5, 0.3, 0.2]))
    q = SparseDistribution(np.array([3, 77, huge]), np.array([0.1, 0.6, 0.3]))
    marginal = speculative_output_marginal(p, q)
    np.testing.assert_array_equal(marginal.token_ids, p.token_ids)
    np.testing.assert_allclose(marginal.probs, p.probs, rtol=0, atol=1e-15)
    np.testing.assert_allclose(acceptance_probability(p, q).probs, [1.0, 0.0, 2 / 3], rtol=0, atol=1e-15)
    residual = residual_distribution(p, q)
    np.testing.assert_array_equal(residual.token_ids, [3, huge - 5])
    np.testing.assert_allclose(residual.probs, [0.4 / 0.7, 0.3 / 0.7], rtol=0, atol=1e-15)


def test_sparse_rejects_mixed_and_unsorted_inputs() -> None:
    with pytest.raises(TypeError):
        acceptance_probability(SparseDistribution(np.array([0]), np.array([1.0])), np.array([1.0]))
    with pytest.raises(ValueError):
        SparseDistribution(np.array([2, 1]), np.array([0.5, 0.5]))


def random_conditional_table(rng: np.random.Generator, vocab_size: int):
    """p(. | prefix), drawn lazily and cached so each prefix has one fixed distribution."""
    table: dict[tuple, np.ndarray] = {}

    def conditional(prefix: tuple) -> np.ndarray:
        if prefix not in table:
            table[prefix] = random_distribution(rng, vocab_size)
        return table[prefix]

    return conditional


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_chain_oracle_equals_autoregressive_joint(seed: int, depth: int) -> None:
    seed = resolve(seed)
    rng = np.random.default_rng(seed * 10 + depth)
    vocab_size = 3
    for trial in range(6 if depth < 4 else 3):
        p_cond = random_conditional_table(rng, vocab_size)
        q_cond = random_conditional_table(rng, vocab_size)
        chain = chain_output_distribution(p_cond, q_cond, depth, vocab_size)
        joint = autoregressive_joint(p_cond, depth + 1, vocab_size)
        assert abs(chain.sum() - 1.0) < 1e-12
        assert np.max(np.abs(chain - joint)) < 1e-12, f"seed {seed} depth {depth} trial {trial}"


def test_chain_oracle_detects_a_wrong_acceptance_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: accepting iff p >= q breaks the equality the chain test checks."""
    monkeypatch.setattr(sampling, "acceptance_probability", lambda p, q: ((p >= q) & (q > 0)).astype(float))
    chain = sampling.chain_output_distribution(
        lambda prefix: np.array([0.6, 0.3, 0.1]), lambda prefix: np.array([0.2, 0.2, 0.6]), 2, 3
    )
    joint = autoregressive_joint(lambda prefix: np.array([0.6, 0.3, 0.1]), 3, 3)
    assert np.max(np.abs(chain - joint)) > 1e-3


# ----------------------------------------------------------------------------
# The pipeline, with hand-computed expectations
# ----------------------------------------------------------------------------


def test_temperature_zero_is_one_hot_at_lowest_argmax() -> None:
    probs = distribution_from_logits(np.array([1.0, 3.0, 3.0, -np.inf]), SamplerConfig(temperature=0))
    np.testing.assert_array_equal(probs, [0.0, 1.0, 0.0, 0.0])


def test_temperature_scales_logits() -> None:
    probs = distribution_from_logits(np.array([0.0, math.log(3.0)]), SamplerConfig(temperature=0.5))
    np.testing.assert_allclose(probs, [0.1, 0.9], rtol=1e-6)  # weights 1 : 9


def test_top_k_keeps_ties() -> None:
    probs = distribution_from_logits(np.array([1.0, 2.0, 2.0, 0.0]), SamplerConfig(top_k=1))
    np.testing.assert_allclose(probs, [0.0, 0.5, 0.5, 0.0], rtol=1e-12)


def test_top_p_threshold_set() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    np.testing.assert_allclose(
        distribution_from_logits(logits, SamplerConfig(top_p=0.8)), [0.625, 0.375, 0.0, 0.0], rtol=1e-6
    )
    np.testing.assert_allclose(
        distribution_from_logits(logits, SamplerConfig(top_p=0.81)),
        [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0],
        rtol=1e-6,
    )
    # Ties at the threshold are all kept: 0.4 + 0.2 reaches 0.5 at the first 0.2.
    tied = np.log(np.array([0.4, 0.2, 0.2, 0.2]))
    np.testing.assert_allclose(
        distribution_from_logits(tied, SamplerConfig(top_p=0.5)), [0.4, 0.2, 0.2, 0.2], rtol=1e-6
    )


def test_min_p_is_relative_to_the_top() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    np.testing.assert_allclose(
        distribution_from_logits(logits, SamplerConfig(min_p=0.25)),
        [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0],
        rtol=1e-6,
    )


def test_penalties_follow_the_documented_conventions() -> None:
    logits = np.array([2.0, -2.0, 1.0, 0.5])
    cfg = SamplerConfig(
        repetition_penalty=2.0,
        repetition_context_size=2,
        presence_penalty=0.25,
        frequency_penalty=0.5,
        logit_bias={3: 1.0},
    )
    # context [2, 0, 1, 1]: repetition window = last 2 = {1}; counts: 0->1, 1->2, 2->1
    penalized = apply_penalties(logits, [2, 0, 1, 1], cfg)
    expected = [2.0 - 0.25 - 0.5, -2.0 * 2.0 - 0.25 - 1.0, 1.0 - 0.25 - 0.5, 0.5 + 1.0]
    np.testing.assert_allclose(penalized, expected, rtol=0, atol=1e-12)
    assert apply_penalties(np.array([4.0, 1.0]), [0], SamplerConfig(repetition_penalty=2.0))[0] == 2.0


def test_defaults_make_penalties_a_no_op() -> None:
    logits = np.array([0.3, -1.7, 2.5])
    assert not SamplerConfig().has_penalties
    np.testing.assert_array_equal(apply_penalties(logits, [0, 1, 1, 2], SamplerConfig()), logits)


def test_context_none_skips_bias_and_empty_context_applies_it() -> None:
    cfg = SamplerConfig(temperature=0, logit_bias={0: 10.0})
    assert distribution_from_logits(np.array([0.0, 1.0]), cfg)[1] == 1.0
    assert distribution_from_logits(np.array([0.0, 1.0]), cfg, context_tokens=[])[0] == 1.0


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_positive_inf_logits_raise(bad: float) -> None:
    with pytest.raises(ValueError):
        distribution_from_logits(np.array([0.0, bad, 1.0]), SamplerConfig())
    with pytest.raises(ValueError):
        sampling.verify_reference(
            np.array([[[0.0, bad], [0.0, 1.0]]]),
            np.array([[0]]),
            None,
            SamplerConfig(),
            np.array([[0.5]]),
            np.array([0.5]),
        )


def test_negative_inf_is_a_masked_token_but_all_masked_raises() -> None:
    np.testing.assert_array_equal(
        distribution_from_logits(np.array([-np.inf, 0.0]), SamplerConfig()), [0.0, 1.0]
    )
    with pytest.raises(ValueError):
        distribution_from_logits(np.array([-np.inf, -np.inf]), SamplerConfig())


# ----------------------------------------------------------------------------
# Validation: every field, named in the message
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field_name, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.2),
        ("top_p", float("nan")),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("min_p", -0.1),
        ("min_p", 1.0),
        ("min_p", float("inf")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("repetition_penalty", 5e-324),  # a denormal: every penalised logit overflowed to inf (server fuzz)
        ("repetition_penalty", 1e7),
        ("temperature", 2.5e-139),  # 0 in float32: logits / 0 drew a NaN token (server fuzz)
        ("temperature", 1e-7),
        ("temperature", 1e7),
        ("repetition_context_size", -1),
        ("repetition_context_size", 1.5),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", float("-inf")),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {3: float("nan")}),
        ("logit_bias", [1, 2]),
    ],
)
def test_invalid_config_raises_naming_the_field(field_name: str, value: object) -> None:
    with pytest.raises(MtplxError, match=field_name):
        SamplerConfig(**{field_name: value})
    assert issubclass(MtplxError, ValueError)


def test_config_errors_name_the_field_as_the_api_spells_it() -> None:
    with pytest.raises(MtplxError) as raised:
        SamplerConfig(temperature=-1.0)
    assert str(raised.value) == "temperature must be >= 0 (got -1.0)"


@pytest.mark.parametrize("temperature", [0.0, 1e-6, 0.7, 1e6])
def test_greedy_and_temperatures_inside_the_float32_range_are_taken(temperature: float) -> None:
    assert SamplerConfig(temperature=temperature).temperature == temperature


def test_sampling_reexports_the_runtime_config() -> None:
    from mtplx.sample import params as config

    assert sampling.SamplerConfig is config.SamplerConfig


def test_config_properties_and_hash() -> None:
    assert SamplerConfig(temperature=0).is_greedy and not SamplerConfig().is_greedy
    assert SamplerConfig(presence_penalty=0.1).has_penalties
    assert SamplerConfig(logit_bias={1: 0.5}).has_penalties
    assert not SamplerConfig(repetition_penalty=1.5, repetition_context_size=0).has_penalties
    assert hash(SamplerConfig(logit_bias={1: 0.5})) == hash(SamplerConfig(logit_bias={1: 0.5}))
    with pytest.raises(TypeError):
        SamplerConfig(logit_bias={1: 0.5}).logit_bias[2] = 1.0  # read-only


def test_bias_token_beyond_vocabulary_raises() -> None:
    with pytest.raises(MtplxError, match="logit_bias"):
        apply_penalties(np.zeros(3), [], SamplerConfig(logit_bias={5: 1.0}))


def test_reference_rejects_uniforms_outside_half_open_interval() -> None:
    logits = np.zeros((1, 2, 3))
    with pytest.raises(ValueError, match="accept_uniforms"):
        sampling.verify_reference(
            logits, np.array([[0]]), None, SamplerConfig(), np.array([[0.0]]), np.array([0.5])
        )
    with pytest.raises(ValueError, match="uniforms"):
        sampling.sample_reference(np.zeros((1, 3)), SamplerConfig(), np.array([1.5]))
