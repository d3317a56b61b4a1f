"""An entry file whose import fails."""
import not_a_real_module_for_nanbisect  # noqa: F401
