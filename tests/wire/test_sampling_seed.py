"""Seeds are checked where SamplingParams is built, so a bad one is a 400 naming "seed", never a step fault."""

from __future__ import annotations

import pytest
import torch

from wire.sampling import MAX_SEED, MAX_STOP_TOKEN_IDS, InvalidSamplingParams, SamplingParams


@pytest.mark.parametrize("seed", [2**64, -1, -(2**63), 10**30])
def test_seeds_outside_the_generators_range_are_refused(seed):
    with pytest.raises(InvalidSamplingParams, match=r"seed must be in \[0, 2\*\*64 - 1\]") as err:
        SamplingParams(seed=seed)
    assert err.value.param == "seed"
    with pytest.raises(InvalidSamplingParams):
        SamplingParams.from_json({"seed": seed})


@pytest.mark.parametrize("seed", [0, 1, 2**63, MAX_SEED])
def test_every_accepted_seed_seeds_a_generator(seed):
    params = SamplingParams(seed=seed)
    assert torch.Generator().manual_seed(params.seed).initial_seed() == seed


def test_stop_token_ids_are_bounded():
    SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    assert err.value.param == "stop_token_ids"
