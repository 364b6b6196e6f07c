"""The drafter registry (`doppler_py.speculative.registry`): one table that the API, the CLI, the server, the router
and the benchmarks read, so a drafter added there is usable everywhere by its name."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from doppler_py import cli, router, server
from doppler_py.api import load
from doppler_py.options import GenerationOptions
from doppler_py.speculative import NoOpHooks, Proposal
from doppler_py.speculative.drafters.heads.files import HEAD_NAMES
from doppler_py.speculative.registry import DRAFTERS, HEAD_KINDS, DrafterSpec, DraftSources
from doppler_py.testing.tiny import TinySpec

PROMPT = "the cat sat on the mat. the cat"


class EchoDrafter(NoOpHooks):
    """Proposes the last committed token k times: mostly wrong, and exactness holds whatever is proposed."""

    name = "echo"

    def propose(self, ctx, k: int) -> Proposal:
        return Proposal(k, [ctx.tokens[-1]] * k)


def test_a_drafter_added_to_the_table_alone_runs_by_its_name_in_the_api_cli_and_server(gpu, tiny_folder, monkeypatch):
    monkeypatch.setitem(DRAFTERS, "echo", DrafterSpec("echo", lambda sources: EchoDrafter(), "echoes its last token"))
    with load(
        tiny_folder(TinySpec(num_hidden_layers=1, seed=3)), "f32", gpu=gpu, max_seq=128, progress=False, warmup="now"
    ) as engine:
        plain = engine.generate(PROMPT, max_tokens=12, chat=False, speculative=None)
        echoed = engine.generate(PROMPT, max_tokens=12, chat=False, speculative="echo", k=3)
    assert echoed.tokens == plain.tokens and echoed.drafted > 0 and echoed.speculative == "echo"
    assert cli.build_parser().parse_args(["generate", "hi", "--speculative", "echo"]).speculative == "echo"
    assert server._options({"speculative": "echo"}, GenerationOptions(), chat=True).speculative == "echo"


def test_every_drafter_is_made_under_its_own_name_and_every_head_kind_can_be_loaded_and_trained(models):
    sources = DraftSources(models["target"], models["draft"], {})
    for name, spec in DRAFTERS.items():
        if spec.head is None:
            drafter = spec.make(sources)
            assert drafter.name == name
            drafter.close()
        else:
            module, function = spec.head.loader.split(":")
            assert callable(getattr(importlib.import_module(module), function)), name
            assert importlib.util.find_spec(spec.head.trainer) is not None, name
    assert HEAD_KINDS == ("eagle", "medusa", "spark")  # "auto" tries the heads in this order
    assert set(HEAD_NAMES) == set(HEAD_KINDS)
    assert set(router.HEAD_TYPES) <= set(HEAD_KINDS) and set(router.DRAFT_MODES.values()) <= set(DRAFTERS)


def test_an_unknown_name_is_refused_with_the_registered_ones():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "hi", "--speculative", "echo"])
    with pytest.raises(server.RequestError, match="prompt-lookup"):
        server._options({"speculative": "echo"}, GenerationOptions(), chat=True)
