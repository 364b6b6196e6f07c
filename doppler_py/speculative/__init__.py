"""Speculative decoding: a draft proposes tokens, the target model verifies them."""

from doppler_py.speculative.compat import SpeculativeDecoder

__all__ = ["SpeculativeDecoder"]
