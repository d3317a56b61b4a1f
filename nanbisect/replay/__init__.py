"""Replaying a bundle's step (`replayer`) and watching it: which module call is running
(`tracker`), per-call statistics (`probe`), every aten op's dataflow and flags (`recorder`)."""
