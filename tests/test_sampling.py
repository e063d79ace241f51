"""Sampling: every bad value is rejected with a message naming it and the allowed range (what the float32 /
int64 tensors hold); the logit bias, the penalties and the log-probabilities have OpenAI's meaning, leave
rows without them bit for bit unchanged, and keep the decode step one graph without host syncs."""

from __future__ import annotations

import math

import pytest
import torch

from beaconkv.sampling import (
    FLOAT32_MAX,
    INT64_MAX,
    MAX_LOGPROBS,
    RowSampling,
    SamplingError,
    SamplingParams,
    sample_rows,
)

from .dispatch import run_graphs_outside_dispatch_modes


@pytest.mark.parametrize("kwargs,fragment", [
    ({"temperature": math.nan}, "temperature=nan must be a finite number (>= 0; 0 = greedy)"),
    ({"temperature": math.inf}, "temperature=inf must be a finite number"),
    ({"temperature": -math.inf}, "temperature=-inf must be a finite number"),
    ({"temperature": -0.1}, "temperature=-0.1 must be >= 0 (0 = greedy)"),
    ({"top_p": math.nan}, "top_p=nan must be a finite number (in (0, 1]; 1 = off)"),
    ({"top_p": 0.0}, "top_p=0.0 must lie in (0, 1]"),
    ({"top_p": 1.5}, "top_p=1.5 must lie in (0, 1]"),
    ({"top_k": -1}, "top_k=-1 must be >= 0 (0 = off)"),
    ({"top_k": 2.5}, "top_k=2.5 must be an int >= 0"),
    ({"temperature": "0.7"}, "temperature='0.7' must be a finite number"),
])
def test_bad_sampling_parameters_are_rejected(kwargs, fragment):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert fragment in str(err.value)


def test_good_sampling_parameters():
    assert SamplingParams().greedy and SamplingParams(0.6, 0.95, 0).temperature == 0.6
    assert SamplingParams(1.0, 1.0, 1).greedy  # top_k=1 is an argmax


# ------------------------------------------------------------------ ranges: what the float32 / int64 tensors hold
@pytest.mark.parametrize("kwargs,field,fragment", [
    ({"temperature": 1e39}, "temperature", "temperature=1e+39 is outside [0, 3.402823e+38]"),
    ({"temperature": 1e308}, "temperature", "is outside [0, 3.402823e+38]"),
    ({"top_k": 2**63}, "top_k", "top_k=9223372036854775808 is outside [0, 9223372036854775807] (int64)"),
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty=2.5 is outside [-2, 2]"),
    ({"frequency_penalty": math.nan}, "frequency_penalty", "frequency_penalty=nan must be a finite number"),
    ({"frequency_penalty": "1"}, "frequency_penalty", "frequency_penalty='1' must be a finite number"),
    ({"logit_bias": {5: 100.5}}, "logit_bias[5]", "logit_bias[5]=100.5 is outside [-100, 100]"),
    ({"logit_bias": {5: math.inf}}, "logit_bias[5]", "logit_bias[5]=inf must be a finite number"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias", "logit_bias key -1 must be a token id"),
    ({"logit_bias": {2**63: 1.0}}, "logit_bias", "must be a token id"),
    ({"logit_bias": 5}, "logit_bias", "logit_bias=5 must map token ids to biases"),
    ({"logprobs": 21}, "logprobs", "logprobs=21 must be None or an int in [0, 20]"),
    ({"logprobs": True}, "logprobs", "logprobs=True must be None or an int"),
])
def test_values_the_sampler_cannot_hold_are_refused_naming_the_field_and_range(kwargs, field, fragment):
    with pytest.raises(SamplingError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field and fragment in str(err.value)


def test_edges_of_the_ranges_are_taken():
    SamplingParams(temperature=FLOAT32_MAX, top_k=INT64_MAX, presence_penalty=-2, frequency_penalty=2,
                   logit_bias={0: -100, 7: 100}, logprobs=MAX_LOGPROBS)
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-5).greedy
    assert SamplingParams(logit_bias={9: 1, 2: -1}).logit_bias == ((2, -1.0), (9, 1.0))  # sorted pairs: hashable
    assert not SamplingParams(temperature=0.7).adjusts and SamplingParams(presence_penalty=0.1).adjusts


# ------------------------------------------------------------------------------------ sample_rows semantics
VOCAB = 50


def _logits(batch=4, seed=0):
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _noise(batch=4, seed=1):
    return torch.empty(batch, VOCAB).exponential_(generator=torch.Generator().manual_seed(seed))


def test_logit_bias_bans_and_forces_tokens_greedy_and_sampled():
    logits = _logits()
    top = logits.argmax(-1).tolist()
    rows = [SamplingParams(logit_bias={top[0]: -100}),  # greedy, its argmax banned
            SamplingParams(logit_bias={7: 100}),  # greedy, token 7 forced
            SamplingParams(temperature=1.0, logit_bias={11: 100}),  # sampled, token 11 forced
            SamplingParams(temperature=1.0, logit_bias=dict.fromkeys(range(VOCAB), -100))]  # a shift changes nothing
    out = sample_rows(logits, RowSampling.of(rows, "cpu", vocab_size=VOCAB), _noise()).tolist()
    assert out[0] == logits[0].clone().index_fill_(0, torch.tensor(top[0]), -1e9).argmax().item() != top[0]
    assert out[1] == 7 and out[2] == 11
    plain = sample_rows(logits[3:], RowSampling.of([SamplingParams(temperature=1.0)], "cpu"), _noise()[3:])
    assert out[3] == plain.item()


def test_penalties_follow_openai_over_the_generated_tokens():
    """logits[j] -= presence * (count[j] > 0) + frequency * count[j]; the counts are the row's own tokens,
    updated in place by every sampling."""
    logits = _logits(2, seed=3)
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=1.3), SamplingParams(frequency_penalty=-2.0)]
    sampling = RowSampling.of(params, "cpu", vocab_size=VOCAB)
    counts = torch.zeros(2, VOCAB)
    for _ in range(12):
        presence, frequency = torch.tensor([[0.7], [0.0]]), torch.tensor([[1.3], [-2.0]])
        expected = (logits - presence * (counts > 0) - frequency * counts).argmax(-1)
        got = sample_rows(logits, sampling)
        assert got.tolist() == expected.tolist()
        counts[torch.arange(2), got] += 1
        torch.testing.assert_close(sampling.counts, counts, rtol=0, atol=0)
    assert len(set(counts[0].nonzero().flatten().tolist())) > 3  # the penalties move row 0 off its argmax
    assert counts[1].max() == 12  # a negative frequency penalty makes row 1 repeat itself


def test_a_row_without_adjustments_is_bit_identical_whatever_its_company():
    logits, noise = _logits(), _noise()
    plain = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9)]
    alone = sample_rows(logits[:2], RowSampling.of(plain, "cpu"), noise[:2])
    company = [*plain, SamplingParams(temperature=1.2, presence_penalty=2, logit_bias={3: 50}, logprobs=5),
               SamplingParams(frequency_penalty=-1, logprobs=0)]
    sampling = RowSampling.of(company, "cpu", vocab_size=VOCAB)
    sampling.counts.fill_(3.0)  # every token already generated three times
    mixed = sample_rows(logits, sampling, noise)
    assert mixed[:2].tolist() == alone.tolist()
    assert sampling.mode.adjust and sampling.mode.logprobs and not RowSampling.of(plain, "cpu").mode.adjust


def test_logprobs_are_the_raw_model_log_softmax_of_the_chosen_and_most_likely_tokens():
    logits = _logits()
    rows = [SamplingParams(logprobs=3), SamplingParams(temperature=2.0, logit_bias={5: 100}, logprobs=MAX_LOGPROBS),
            SamplingParams(presence_penalty=1.0, logprobs=0), SamplingParams()]
    sampling = RowSampling.of(rows, "cpu", vocab_size=VOCAB)
    tokens = sample_rows(logits, sampling, _noise())
    raw = logits.log_softmax(-1)  # before bias, penalties, temperature: what vLLM reports by default
    torch.testing.assert_close(sampling.logprob, raw.gather(-1, tokens[:, None])[:, 0])
    top = raw.topk(MAX_LOGPROBS, dim=-1)
    torch.testing.assert_close(sampling.top_logprobs, top.values)
    assert sampling.top_ids.tolist() == top.indices.tolist() and tokens[1] == 5


def test_extreme_temperatures_and_top_p_never_give_nan():
    logits = _logits(3) * 30  # logits up to ~300: a temperature of 1e-7 would overflow float32
    rows = [SamplingParams(temperature=1e-7), SamplingParams(temperature=FLOAT32_MAX),
            SamplingParams(temperature=1.0, top_p=1e-50)]  # a top_p that is 0 in float32
    out = sample_rows(logits, RowSampling.of(rows, "cpu"), _noise(3))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax() and 0 <= out[1] < VOCAB


# ----------------------------------------------------------- the decode step with every feature: one graph, no sync
def _run_every_feature(model, compile_config):
    from beaconkv.execution.sync import no_host_sync
    from beaconkv.session import Session

    torch.manual_seed(0)
    session = Session.for_prompts(model, None, [9, 9, 9], 6, compile=compile_config or False)
    prompts = torch.randint(3, 97, (3, 9), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():  # as the engine runs: every step's tokens are inference tensors
        tokens = session.prefill(prompts).argmax(-1)
    rows = [SamplingParams(logit_bias={5: 3.0, 9: -100}, presence_penalty=0.5, logprobs=2),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=20, frequency_penalty=1.5, logprobs=MAX_LOGPROBS),
            SamplingParams()]
    sampling = RowSampling.of(rows, model.device, vocab_size=model.config.vocab_size)
    noise = torch.empty(3, model.config.vocab_size).exponential_(generator=torch.Generator().manual_seed(0))
    out, logprobs = [], []
    with no_host_sync():
        for _ in range(6):
            tokens = session.step(tokens, sampling, noise)
            out.append(tokens)
            logprobs.append(sampling.logprob.clone())
    return torch.stack(out), torch.stack(logprobs), sampling.counts.clone()


def test_the_decode_step_with_bias_penalties_and_logprobs_is_one_graph_without_host_sync(llama, monkeypatch):
    """Eagerly under the host-sync guard, and compiled (``fullgraph=True``: one graph, or it raises) with aot_eager,
    whose graphs run outside the guard while the host code around them stays inside it; the same results."""
    from beaconkv.execution import CompileConfig

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eager = _run_every_feature(llama, None)
        run_graphs_outside_dispatch_modes(monkeypatch)
        compiled = _run_every_feature(llama, CompileConfig(backend="aot_eager"))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[2], compiled[2])
    torch.testing.assert_close(eager[1], compiled[1])
    assert eager[2].sum(-1).tolist() == [6.0, 6.0, 6.0]  # every step counted once per row, on the device
    assert (eager[0][:, 0] != 9).all()  # the banned token never comes
