"""Make Triton 3.6's interpreter (TRITON_INTERPRET=1, kernels on CPU tensors) work with NumPy >= 2.4.

The interpreter holds scalars as 1-element arrays and turns them into Python ints with
`int(array)`, which NumPy 2.4 rejects for arrays with a dimension ("only 0-dimensional
arrays can be converted to Python scalars"): any loop bound read from memory fails.
We wrap its per-launch patching of `tl.tensor` so `__index__` goes through `.item()`.
Compiled kernels (GPU) never take this path.
"""

from __future__ import annotations

import os

_applied = False


def apply_interpreter_numpy_fix() -> None:
    global _applied
    if _applied or os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # a Triton without this hook: nothing to fix here
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        # Restored (LIFO) with the interpreter's own patches when the launch ends.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor
    _applied = True
