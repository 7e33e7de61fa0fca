"""Each Beam internal that batchinfer.beam_compat wraps, exercised against the installed Beam: an
upgrade that moves or changes one fails here, by name, instead of inside a run."""
from __future__ import annotations

import inspect
import pickle
import sys

import apache_beam as beam


def test_beam_is_imported_first_by_the_runner_check_without_what_batchinfer_never_uses():
    """A run's runner check is what imports Beam first: through beam_compat, which hides torch
    and boto3 (Beam's inference base and options module import them when they can: 1-6 s of
    torch), and for the direct runner also the Dataflow client and Beam's GCS/S3/BigQuery I/O
    (0.3-0.7 s here with the dataflow extra installed). Each stays importable afterwards, and a
    filesystem imported later is registered with Beam's FileSystems."""
    import subprocess

    from batchinfer.imports import CLOUD_CLIENTS

    code = ("import sys; from batchinfer.imports import CLOUD_CLIENTS as C; "
            "from batchinfer.pipeline.runner_options import check; check('direct', {}); "
            "import batchinfer.beam_compat as c; "
            "print(c.RunInference.__name__, *(m in sys.modules for m in ('torch', 'boto3', *C))); "
            "import boto3, apache_beam.io.gcp.gcsfilesystem; "
            "from apache_beam.io.filesystems import FileSystems; "
            "print(type(FileSystems.get_filesystem('gs://b/x')).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["RunInference", "False", "False",
                                  *["False"] * len(CLOUD_CLIENTS), "GCSFileSystem"], out.stdout


def test_model_handler_has_the_hooks_batchinfer_overrides():
    from batchinfer.beam_compat import ModelHandler

    for name in ("load_model", "run_inference", "get_num_bytes", "get_metrics_namespace",
                 "batch_elements_kwargs"):
        assert callable(getattr(ModelHandler, name, None)), name
    params = inspect.signature(ModelHandler.run_inference).parameters
    assert list(params)[:4] == ["self", "batch", "model", "inference_args"]
    assert "min_batch_size" in inspect.signature(ModelHandler.__init__).parameters or \
        "kwargs" in inspect.signature(ModelHandler.__init__).parameters


def test_prediction_result_carries_example_and_inference():
    from batchinfer.beam_compat import PredictionResult

    result = PredictionResult("example", "inference")
    assert (result.example, result.inference) == ("example", "inference")


def test_size_estimating_coder_impl_sizes_without_encoding():
    from batchinfer.beam_compat import size_estimating_coder_impl

    encoded = []

    def encode(value):
        encoded.append(value)
        return pickle.dumps(value)

    impl = size_estimating_coder_impl(encode, pickle.loads, lambda value: 12345)
    assert impl.estimate_size({"a": 1}) == 12345
    assert encoded == []                          # sizing never encoded
    assert impl.decode(impl.encode({"a": 1})) == {"a": 1}


def test_coder_create_impl_hook_is_used():
    from batchinfer.pipeline.coders import SizedPickleCoder

    class Sized:
        def nbytes(self):
            return 777

    assert SizedPickleCoder().get_impl().estimate_size(Sized()) == 777


def test_in_global_window_is_a_windowed_value_of_the_global_window():
    from apache_beam.transforms.window import GlobalWindow

    from batchinfer.beam_compat import in_global_window

    value = in_global_window("x")
    assert value.value == "x" and list(value.windows) == [GlobalWindow()]


def test_finish_bundle_output_reaches_the_pipeline():
    """The use that needs in_global_window: elements emitted from finish_bundle."""
    from apache_beam.testing.util import assert_that, equal_to

    from batchinfer.beam_compat import in_global_window
    from batchinfer.pipeline.runner_options import pipeline_options

    class Late(beam.DoFn):
        def start_bundle(self):
            self.seen = []

        def process(self, element):
            self.seen.append(element)

        def finish_bundle(self):
            for element in self.seen:
                yield in_global_window(element * 2)

    with beam.Pipeline(options=pipeline_options("direct", {})) as pipeline:
        out = pipeline | beam.Create([1, 2, 3]) | beam.ParDo(Late())
        assert_that(out, equal_to([2, 4, 6]))


def test_option_flags_are_beams_own_by_class_and_name_every_runner_class_batchinfer_knows():
    """``pipeline/runner_options.py`` refuses a flag that is not in these, and names the runner a
    class belongs to: a class Beam renames or moves must fail here, not let options through."""
    import batchinfer.pipeline.dask  # noqa: F401  (registers Beam's DaskOptions)
    from batchinfer.beam_compat import option_flags
    from batchinfer.runners import option_owners

    flags = {cls.__name__: names for cls, names in option_flags().items()}
    assert set(option_owners()) <= set(flags)
    assert {"--dask_client_address", "--dask_partition_size"} <= set(flags["DaskOptions"])
    assert "--direct_num_workers" in flags["DirectOptions"] and "--help" not in flags["DirectOptions"]
    assert "--no_use_public_ips" in flags["WorkerOptions"]  # aliases and negations are flags too


def test_dask_bundles_applied_by_is_scoped_and_restored():
    """pipeline/dask.py swaps the DaskRunner's bundle function only while it builds a graph."""
    from apache_beam.runners.dask import transform_evaluator

    from batchinfer.beam_compat import dask_bundles_applied_by

    stock = transform_evaluator.apply_dofn_to_bundle

    def ours(*args):
        return []

    with dask_bundles_applied_by(ours):
        assert transform_evaluator.apply_dofn_to_bundle is ours
    assert transform_evaluator.apply_dofn_to_bundle is stock
    try:
        with dask_bundles_applied_by(ours):
            raise RuntimeError("graph failed")
    except RuntimeError:
        pass
    assert transform_evaluator.apply_dofn_to_bundle is stock
    # What the swap relies on: ParDo's translation names the module's function at build time.
    source = inspect.getsource(transform_evaluator.ParDo.apply)
    assert "apply_dofn_to_bundle," in source


def test_pipeline_handing_over_tells_the_result_before_the_wait_and_restores_run():
    from batchinfer.beam_compat import pipeline_handing_over

    seen: list[tuple[str, object]] = []
    with pipeline_handing_over(beam.options.pipeline_options.PipelineOptions([]),
                               lambda result: seen.append(("result", result.state))) as pipeline:
        _ = pipeline | beam.Create([1, 2, 3]) | beam.Map(lambda x: x * 2)
        assert "run" in vars(pipeline)
    assert len(seen) == 1 and seen[0][0] == "result"
    assert pipeline.result.state == "DONE"
    assert "run" not in vars(pipeline)   # the class's method again
    # An exception in the block: nothing runs, nothing is told, run is restored.
    told: list[object] = []
    try:
        with pipeline_handing_over(beam.options.pipeline_options.PipelineOptions([]),
                                   told.append) as failed:
            raise ValueError("build failed")
    except ValueError:
        pass
    assert told == [] and "run" not in vars(failed) and not hasattr(failed, "result")


def test_nothing_outside_beam_compat_assigns_to_beam():
    """Beam is patched only in beam_compat: no module of batchinfer assigns an attribute of a
    name it imported from apache_beam, and no method is replaced under a type: ignore."""
    import ast
    from pathlib import Path

    import batchinfer

    root = Path(batchinfer.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "beam_compat.py" or "demo/files" in path.as_posix():
            continue
        text = path.read_text()
        if "method-assign" in text:
            found.append(f"{path.relative_to(root)}: a method replaced under type: ignore")
        tree = ast.parse(text)
        beam_names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("apache_beam"):
                beam_names |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                beam_names |= {(a.asname or a.name).split(".")[0] for a in node.names
                               if a.name.startswith("apache_beam")}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                base = target
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(target, ast.Attribute) and isinstance(base, ast.Name) \
                        and base.id in beam_names:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(target)}")
    assert found == []
