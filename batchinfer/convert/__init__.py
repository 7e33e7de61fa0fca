"""The converters of ``batchinfer export``: a model converted for a faster backend, and proved to
still agree —

- ``export``: the entry (:func:`export.export_model`), and ``.pt2`` → ONNX;
- ``tensorrt_engine``: ONNX → a TensorRT engine (``--to tensorrt``);
- ``quantize``: ONNX → INT8 ONNX (``--quantize int8``);
- ``int8_gate``: what an INT8 model must keep of the FP32 model's answers, and its figures;
- ``smoothing``: SmoothQuant, the graph transform before INT8 (``--smooth ALPHA``);
- ``samples``: the rows an export is checked on (a job's input, prepared as a run prepares it);
- ``written``: ``--out`` checked, written to scratch and renamed into place; the report; digests.

May import the application layer (``app``: a job's sample rows, read as a run reads them), every
package below it and the core; only ``commands`` imports it.
"""
