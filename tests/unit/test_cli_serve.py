"""`asyncrl serve` backend plumbing."""

from __future__ import annotations

import pytest

from asyncrl.cli import build_parser


def test_serve_defaults_to_the_local_backend():
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert args.backend == "local" and args.host == "127.0.0.1"


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_serve_with_an_unwired_backend_says_so(backend):
    args = build_parser().parse_args(["serve", "--model", "m", "--backend", backend])
    with pytest.raises(SystemExit, match=f"--backend {backend} is not wired yet"):
        args.func(args)
