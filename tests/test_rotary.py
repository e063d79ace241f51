"""The one rotate-half rotation: its algebra, and that the model, the transformers integration and the
policies all use this one definition."""

from __future__ import annotations

import torch

from beaconkv.rotary import rotate, rotate_half


def test_rotate_half_maps_halves_and_twice_negates() -> None:
    x = torch.arange(8.0).reshape(2, 4)
    assert torch.equal(rotate_half(x), torch.tensor([[-2.0, -3.0, 0.0, 1.0], [-6.0, -7.0, 4.0, 5.0]]))
    assert torch.equal(rotate_half(rotate_half(x)), -x)


def test_rotate_by_a_quarter_turn_is_rotate_half_and_preserves_norm() -> None:
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))
    ones, zeros = torch.ones(16), torch.zeros(16)
    assert torch.equal(rotate(x, zeros, ones), rotate_half(x))
    assert torch.equal(rotate(x, ones, zeros), x)
    angle = torch.rand(8, generator=torch.Generator().manual_seed(1)) * 6.28
    cos, sin = torch.cat((angle.cos(), angle.cos())), torch.cat((angle.sin(), angle.sin()))
    torch.testing.assert_close(rotate(x, cos, sin).norm(dim=-1), x.norm(dim=-1))


def test_every_layer_takes_the_one_definition() -> None:
    from beaconkv.hf import rotary as hf_rotary
    from beaconkv.models import rope
    from beaconkv.policies import expected_attention

    assert rope.rotate_half is rotate_half and hf_rotary.rotate_half is rotate_half
    assert expected_attention.rotate is rotate
