"""Structured output: grammars (JSON schema, regex, choice, EBNF) compiled against the vocabulary, and per-request
matchers that give the sampler its token masks. Below the engine: nothing here imports it.

`params.py` imports nothing heavy (SamplingParams, and so `import reasoning_engine`, load it); `compiler.py` and
`matcher.py` need torch and xgrammar, so this package's __init__ imports none of them.
"""
