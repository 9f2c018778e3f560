"""CudaGraphs._record where a capture fails: the stream it ran on is the current one again.

torch.cuda.graph's __exit__ calls capture_end, then restores the stream; where the captured
body broke the capture, capture_end raises first and the thread stays on the capture's
stream. The CUDA calls are stood in for here (no GPU): a capture whose end raises, as an
invalidated one does."""

from __future__ import annotations

import contextlib

import pytest
import torch

from backoff_core.runners.cuda_graphs import CudaGraphs
from backoff_core.runners.graph_plan import GraphKey
from tests.support.eager_graphs import static
from tests.support.tiny import tiny_model


class _Stream(str):
    def wait_stream(self, other) -> None:
        pass


LOOP, SIDE, CAPTURE = _Stream("loop"), _Stream("side"), _Stream("capture")


class _Cuda:
    """The torch.cuda calls _record makes, with a current stream that a capture switches."""

    def __init__(self, end_raises: bool) -> None:
        self.current, self.end_raises = LOOP, end_raises

    def current_stream(self):
        return self.current

    def set_stream(self, stream) -> None:
        self.current = stream

    @contextlib.contextmanager
    def stream(self, stream):
        before, self.current = self.current, stream
        yield
        self.current = before

    def graph(self, graph, pool=None, capture_error_mode=None):
        cuda = self

        class Capture:  # torch.cuda.graph's order: capture_end, then the stream back
            def __enter__(self):
                self.before, cuda.current = cuda.current, CAPTURE

            def __exit__(self, *exc):
                if cuda.end_raises:
                    raise RuntimeError("operation not permitted when stream is capturing")
                cuda.current = self.before

        return Capture()


@pytest.mark.parametrize("end_raises", [False, True])
def test_a_failed_capture_leaves_the_stream_it_ran_on(monkeypatch, end_raises):
    run = static(tiny_model(2, hidden=32, layers=1), slots=2)
    graphs = CudaGraphs(run._forward, run.graph_max_rows, max_k=1)
    cuda = _Cuda(end_raises)
    for name in ("current_stream", "set_stream", "stream", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda: SIDE)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")

    def broken(key):  # the captured body fails (a host sync, say), after its warm-up ran
        if cuda.current is CAPTURE:
            raise RuntimeError("cudaErrorStreamCaptureUnsupported")

    monkeypatch.setattr(graphs, "_body", broken)
    with pytest.raises(RuntimeError):
        graphs._record(GraphKey(True, 1, 1, 128, True, None))
    assert cuda.current is LOOP
