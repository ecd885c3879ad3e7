"""Structured output: grammars compiled with xgrammar, per-request matchers, masks applied to logits.

`compiler.GrammarCache` turns a request's `StructuredOutputs` into an xgrammar `CompiledGrammar` for the
engine's tokenizer, with an LRU cache keyed by (kind, constraint text); `state.RequestConstraint` is one
request's matcher (and logit bias); `runtime.ConstrainRuntime` is what the workers call at a few
delimited points of a step: which rows of a batch are constrained, the token bitmask of each row filled
on the host and applied to the logits on the device (`bitmask.apply_bitmask`), the matcher advanced by
the tokens a step emitted, and under speculation advanced tentatively over each draft step's token
then rolled back. xgrammar is imported only when the first constraint is compiled, so an engine
that never sees one does not pay its import.
"""
