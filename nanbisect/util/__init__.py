"""Stage 0: the one home of each small utility the stages share (file hashing, staging names,
atomic small-file writes, environment numbers, NaN/inf counting, tensor digests).

Guarantees: these modules import only the standard library, torch (`tensors` alone) and
`nanbisect.errors`, so every stage may use them; importing this package imports none of them
(`nanbisect.nightly` stays free of torch).
Not guaranteed: anything about bundles or reports; those rules live in their own stages.
"""
