"""The converters of ``batchinfer export``: a model converted for a faster backend, and proved to
still agree —

- ``export``: ``.pt2`` → ONNX, ONNX → TensorRT, and INT8 quantization with its parity gate;
- ``smoothing``: SmoothQuant, the graph transform before INT8 (``--smooth ALPHA``).

May import the application layer (``app``: a job's sample rows, read as a run reads them), every
package below it and the core; only ``commands`` imports it.
"""
