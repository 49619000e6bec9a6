"""Structured output: grammars (JSON schema, regex, choice, Lark/GBNF) compiled by llguidance, and
the token bitmasks that constrain sampling to them.

`grammar.py` turns `StructuredOutputsParams` into an llguidance grammar and validates it (no torch:
the API process uses it to answer a 400 before a request enters the engine); `compiler.py` compiles
grammars for the engine core off its loop and caches them by content; `bitmask.py` fills a batch's
token bitmask and applies it to the logits in the sampler.
"""
