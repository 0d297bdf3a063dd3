"""A stand-in for Hugging Face ``datasets``, put on the path by the GPU check only where ``datasets`` is not
installed (its pyarrow and pandas alone are ~62 MB, more than a device run carries).

speculators 0.9 imports ``datasets`` at module level for its own trainer's data loading
(``speculators.train.data``: ``load_from_disk``), which ``Eagle3DraftModel`` never calls; draftline reads its
own shards. Any name resolves to a placeholder that raises when used, so a use is an error, never silence.
"""

__version__ = "0.0.0+draftline-gpu-check-standin"


class _Missing:
    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise ImportError(f"datasets.{self._name}: the GPU check's stand-in for datasets cannot do this; install "
                          "datasets on this machine")

    def __getattr__(self, attr):
        return _Missing(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (object,)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name)
