#!/usr/bin/env python3
"""The bench model (``make_data.py``'s ONNX MLP: Gemm/Relu layers, then Sigmoid) as a
``torch.export`` program with the same weights, for the torch backend's side of the bench.

  onnx_to_pt2.py model.onnx model.pt2

The program's output is named ``sigmoid`` (as torch names it); its predictions equal the ONNX
model's within float32 rounding (checked here on 4,096 random rows, max abs diff printed).
"""
import sys

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

source, target = sys.argv[1], sys.argv[2]
graph = onnx.load(source).graph
weights = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
layers: list[torch.nn.Module] = []
for node in graph.node:
    if node.op_type == "Gemm":
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        w, b = weights[node.input[1]], weights[node.input[2]]
        w = w if attrs.get("transB", 0) else w.T              # torch keeps [out, in]
        linear = torch.nn.Linear(w.shape[1], w.shape[0])
        linear.weight.data = torch.from_numpy(np.ascontiguousarray(w))
        linear.bias.data = torch.from_numpy(np.ascontiguousarray(b))
        layers.append(linear)
    elif node.op_type == "Relu":
        layers.append(torch.nn.ReLU())
    elif node.op_type == "Sigmoid":
        layers.append(torch.nn.Sigmoid())
    else:
        sys.exit(f"onnx_to_pt2: unexpected {node.op_type} node in {source}")
model = torch.nn.Sequential(*layers).eval()
features = layers[0].in_features
program = torch.export.export(model, (torch.randn(8, features),),
                              dynamic_shapes=({0: torch.export.Dim("batch")},))
torch.export.save(program, target)
x = np.random.default_rng(0).standard_normal((4096, features)).astype(np.float32)
want = ort.InferenceSession(source, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
with torch.no_grad():
    got = torch.export.load(target).module()(torch.from_numpy(x)).numpy()
diff = float(np.max(np.abs(want - got)))
print(f"wrote {target}: {len(layers)} layers, max |onnx - torch| {diff:.3g} on 4,096 rows")
sys.exit(0 if diff < 1e-5 else 1)
