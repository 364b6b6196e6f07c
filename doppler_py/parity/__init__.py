"""Parity with the JS original (npm doppler-gpu): the port of its SpeculativeDecoder class, quirks included,
and fetching the package, verified, for the tests that run it beside ours."""

from doppler_py.parity.speculative_decoder import SpeculativeDecoder

__all__ = ["SpeculativeDecoder"]
