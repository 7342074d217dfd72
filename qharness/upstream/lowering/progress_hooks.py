"""Progress of delegation: each backend's preprocess of its partitions, counted as it goes (not a speed-up).

Not in ``PATCHES``: it changes no output and reports under ``QHARNESS_UPSTREAM_LOWERING=1`` too.
"""

from __future__ import annotations

import contextlib
import inspect

from qharness.upstream.lowering.patching import patched


@contextlib.contextmanager
def delegation_progress(start):
    """Within this block, ``start(backend_id, partitions)`` is called when ExecuTorch hands a backend its delegated
    partitions (``lower_all_submodules_to_backend``, exir/backend/backend_api.py, once per partitioner) and returns a
    progress object: ``update(1)`` after each partition's ``preprocess`` (XNNPACK: its passes, weight packing,
    serialization), ``close()`` when the backend is done.

    Example::

        with delegation_progress(lambda backend, n: tqdm(total=n, desc=backend)):
            edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
    """
    import executorch.exir.backend.backend_api as backend_api
    from executorch.exir.backend.backend_details import BackendDetails

    upstream = backend_api.lower_all_submodules_to_backend

    def lower_all_submodules_to_backend(backend_id, method_to_submodules_nodes, *args, **kwargs):
        backends = {cls.__name__: cls for cls in BackendDetails.__subclasses__()}
        partitions = sum(len(nodes) for nodes in method_to_submodules_nodes.values())
        if backend_id not in backends or not partitions:
            return upstream(backend_id, method_to_submodules_nodes, *args, **kwargs)
        progress = start(backend_id, partitions)
        try:
            with counted_preprocess(backends[backend_id], progress):
                return upstream(backend_id, method_to_submodules_nodes, *args, **kwargs)
        finally:
            progress.close()

    with patched(backend_api, "lower_all_submodules_to_backend", lower_all_submodules_to_backend):
        yield


def counted_preprocess(backend, progress):
    """``backend.preprocess`` (a static or class method) calling ``progress.update(1)`` after each partition."""
    raw = inspect.getattr_static(backend, "preprocess")
    if not isinstance(raw, (staticmethod, classmethod)):
        return contextlib.nullcontext()
    fn = raw.__func__

    def counted(*args, **kwargs):
        result = fn(*args, **kwargs)
        progress.update(1)
        return result

    return patched(backend, "preprocess", type(raw)(counted))
