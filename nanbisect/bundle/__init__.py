"""The bundle: its on-disk format (`format`), the encoding of training state (`state`), what
`nanbisect inspect` shows (`describe`) and ticket archives (`pack`: its limits, the proof that an
archive is a pack, the reader of archives from anyone, `pack` and `unpack`, one module). Reading a
bundle never runs code and never unpickles.

What the package's modules share (named without an underscore, for these modules; code outside
the package reads a bundle through `format`'s `Bundle`/`read_bundle` and `manifest`'s `Manifest`):

- `bounded` (reading files nobody vouches for) to `format`, `schema` and `codestore`:
  `RECOPY_FIX` (the fix a refusal of a damaged file names), `kind_of` (what a JSON value is, for
  a message), `is_uint` (a size or offset), `too_deep` (nesting, level by level),
  `regular_file` (lstat: a plain file, no link), `load_tensors` (a safetensors file's tensors,
  its header checked first);
- `schema` (the manifest's fields and their types) to `format`, `writer` and `codestore`:
  `REQUIRED` / `REQUIRED_MULTI` (the fields a part's / a multi-rank top manifest must have),
  `check_fields` (required fields, their types, the sections), `check_replicas` (the top
  manifest's ``replicas``), `safe_name` (a plain entry of the bundle directory), `is_int` and
  `is_strs` (a JSON integer, a list of strings);
- `code` (code identity) to `state`: `is_user_file` (a user source file, as `user_sources`
  counts them);
- `format` to `describe`: `Bundle.header` (a tensor file's header, the one `read_bundle` checked
  when it kept it).
"""
