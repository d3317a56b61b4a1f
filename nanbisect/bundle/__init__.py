"""The bundle: its on-disk format (`format`), the encoding of training state (`state`), what
`nanbisect inspect` shows (`summary`) and ticket archives (`pack`). Reading a bundle never runs
code and never unpickles."""
