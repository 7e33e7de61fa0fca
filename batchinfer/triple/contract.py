"""The version triple and the model's declaration of it (contract §1).

Pure functions compute the parts (digests, preprocess hash); the declaration is read from a
sidecar ``<model file>.batchinfer.json`` or, for ``models:/name/version`` URIs, from the model
version's tags. :func:`check_contract` compares what a job would run with what the model
declares and raises one :class:`~batchinfer.errors.ContractError` naming every part.
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from ..errors import Action, ContractError, ModelFileError, Remedy, StorageError, one_line
from ..io.storage import local_path, url_to_fs

PREPROCESS_PREFIX = "batchinfer-preprocess/1\n"
SIDECAR_SUFFIX = ".batchinfer.json"
TAG_PREFIX = "batchinfer."
PARTS = ("model_version", "model_digest", "schema_version", "preprocess_hash")
# What the declaration records beside the triple about the code the triple's names stand for.
SCHEMA_SHA256 = "schema_sha256"            # sha256 of the schema version's LF source
PACKAGES = "preprocess_packages"           # "numpy==2.4.6 pyarrow==25.0.1": installed, imported
PACKAGES_POLICY = "preprocess_packages_policy"
PACKAGE_POLICIES = ("warn", "refuse")      # what a run does when PACKAGES differ
STAMP = Remedy(Action.STAMP)                            # what a missing or broken declaration needs
FOR_THIS_ONE = Remedy(Action.STAMP, "for this one")     # a declaration of other values than the job's
# Formats that unpickle arbitrary objects on load; refused unless the job opts in.
PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt", ".pth", ".joblib", ".ckpt", ".bin")


@dataclass(frozen=True)
class Triple:
    """What a partition was scored under: model, schema and preprocessing versions."""

    model_version: str
    model_digest: str
    schema_version: str
    preprocess_hash: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


# -- preprocess hash ---------------------------------------------------------------------------

def preprocess_hash(module: str, function: str, source_text: str,
                    assets: Sequence[tuple[str, bytes]] = (),
                    modules: Sequence[tuple[str, str]] = ()) -> str:
    """sha256 of the preprocessing code, as contract §1 defines it.

    ``"batchinfer-preprocess/1\\n<module>:<function>\\n"`` then the module's source with LF line
    endings. Each asset listed in the module's ``ASSETS`` then adds, in the listed order,
    ``"\\nasset <path as listed> <byte length>\\n"`` and its bytes, so a changed tokenizer file
    changes the hash just as changed code does. Each local module the preprocessing imports
    (``modules``: dotted name and source) then adds, in name order,
    ``"\\nmodule <dotted name> <byte length>\\n"`` and its LF source, so a changed helper changes
    the hash too. A module without local imports hashes as it always did.
    """
    h = hashlib.sha256()
    h.update(f"{PREPROCESS_PREFIX}{module}:{function}\n".encode())
    h.update(source_text.replace("\r\n", "\n").encode("utf-8"))
    for name, data in assets:
        h.update(f"\nasset {name} {len(data)}\n".encode())
        h.update(data)
    for name, text in sorted(modules):
        data = text.replace("\r\n", "\n").encode("utf-8")
        h.update(f"\nmodule {name} {len(data)}\n".encode())
        h.update(data)
    return h.hexdigest()


def default_preprocess_hash(features: Sequence[str]) -> str:
    """The hash of "no preprocess function": FEATURES cast to float32, in order."""
    text = f"{PREPROCESS_PREFIX}default-float32\n" + ",".join(features)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# -- model digest ------------------------------------------------------------------------------

def model_files(model_path: str | Path) -> list[Path]:
    """The files whose bytes make up the model: the file, then ONNX external data by name.

    Raises:
        ModelFileError: the model file (or an external-data file) does not exist, or an ``.onnx``
            file is not an ONNX model.
        ContractError: an external-data path leaves the model's folder (safe loading).
    """
    path = Path(model_path)
    if not path.is_file():
        raise ModelFileError(f"model file {model_path} not found")
    if path.suffix.lower() != ".onnx":
        return [path]
    return [path, *onnx_external_files(path)]


def onnx_external_files(path: Path) -> list[Path]:
    """External-data files an ONNX model refers to, sorted by name, all inside its folder."""
    folder = path.parent.resolve()
    files = []
    for location in onnx_external_locations(path):
        target = (folder / location).resolve()  # resolves symlinks
        if not target.is_relative_to(folder):
            raise ContractError(
                f"{path}: external data {location!r} leaves the model's folder; refusing to load "
                f"it (keep external-data files beside the model)")
        if not target.is_file():
            raise ModelFileError(f"{path}: external data file {location!r} not found")
        files.append(folder / location)
    return files


def onnx_external_locations(path: Path) -> list[str]:
    """The ``location`` of each external-data file an ONNX model refers to, sorted, as written
    in the model (relative to its folder): what a fetch from a store brings along beside it.

    Raises:
        ModelFileError: not an ONNX model.
        ContractError: a location that is absolute or climbs out of the model's folder.
    """
    if _refers_to_no_external_data(path):
        return []
    import onnx  # only needed for ONNX models, and only for one that may refer to external data

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ModelFileError(f"{path} is not a readable ONNX model: {one_line(exc)}") from None
    locations: set[str] = set()
    for tensor in _all_tensors(proto.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    locations.add(entry.value)
    for location in locations:
        plain = posixpath.normpath(location.replace("\\", "/"))
        if os.path.isabs(location) or plain.startswith(("/", "../")) or plain == "..":
            raise ContractError(
                f"{path}: external data {location!r} leaves the model's folder; refusing to load "
                f"it (keep external-data files beside the model)")
    return sorted(locations)


def _refers_to_no_external_data(path: Path) -> bool:
    """Whether the file reads as an ONNX ``ModelProto`` with a graph and holds no tensor stored
    outside it, told without the ``onnx`` package (whose import is ~0.5 s of every run's start).

    A tensor stored outside the model names its file under the key ``location``: bytes without
    ``b"location"`` refer to no external file. Its top level must read as protobuf fields with the
    graph (field 7) among them; a file that does not, or that holds the word, is left to ``onnx``
    to read or refuse (False)."""
    import mmap

    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(b"location") < 0 and 7 in _top_level_fields(data)
    except (OSError, ValueError):   # empty (mmap refuses 0 bytes), unreadable: onnx says why
        return False


def _top_level_fields(data: Any) -> set[int]:
    """The field numbers of a protobuf message's top level; empty if the bytes are not one."""
    def varint(at: int) -> tuple[int, int]:
        value = shift = 0
        while at < len(data) and shift < 64:
            byte = data[at]
            value |= (byte & 0x7F) << shift
            at += 1
            if not byte & 0x80:
                return value, at
            shift += 7
        raise ValueError("truncated varint")

    fields: set[int] = set()
    at = 0
    try:
        while at < len(data):
            tag, at = varint(at)
            number, wire = tag >> 3, tag & 7
            if number == 0:
                return set()
            if wire == 0:
                _, at = varint(at)
            elif wire == 1:
                at += 8
            elif wire == 2:
                size, at = varint(at)
                at += size
            elif wire == 5:
                at += 4
            else:
                return set()
            fields.add(number)
    except ValueError:
        return set()
    return fields if at == len(data) else set()


def _all_tensors(graph) -> Iterable:
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _all_tensors(attr.g)
            for sub in attr.graphs:
                yield from _all_tensors(sub)


def digest_files(files: Sequence[Path]) -> str:
    """sha256 over the files' bytes, concatenated in the given order."""
    h = hashlib.sha256()
    for file in files:
        with open(file, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def model_digest(model_path: str | Path) -> str:
    return digest_files(model_files(model_path))


def refuse_pickle(model_path: str | Path, allow_pickle: bool = False) -> None:
    """Safe loading: refuse pickle-based model formats unless the job explicitly allows them."""
    if not allow_pickle and str(model_path).lower().endswith(PICKLE_SUFFIXES):
        raise ContractError(
            f"{model_path} is a pickle-based format, which can run arbitrary code when loaded; "
            f"export it to ONNX or torch.export (.pt2) instead")


# -- declarations ------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, eq=False)
class Declaration(Mapping[str, str]):
    """A model's declaration (contract §1): what ``batchinfer stamp`` writes beside the model
    (the sidecar's keys, in this order) or as its registry version's ``batchinfer.*`` tags, and
    what a run checks before it scores. Every key is declared here, once; the backend's declared
    values (``backend``: its declared options and build facts — ``precision``,
    ``tensorrt_version``, ``quantization_*``, …, in the order stamp gives them) sit after the
    triple, and a key of a declaration read back that is none of the fields is the backend's.
    A part read back without its key is None (:func:`check_contract` says what is missing).

    A read-only mapping of its keys to their values too (as the file has them), for whoever
    looks a key up by name (a backend's runtime facts)."""

    model_version: str | None = None
    model_digest: str | None = None
    schema_version: str | None = None
    preprocess_hash: str | None = None
    backend: dict[str, str] = field(default_factory=dict)
    explain: str | None = None                     # app/explain_plan.py DECLARED
    explain_background_sha256: str | None = None   # app/explain_plan.py BACKGROUND_SHA256
    schema_sha256: str | None = None               # SCHEMA_SHA256
    preprocess_packages: str | None = None         # PACKAGES
    preprocess_packages_policy: str | None = None  # PACKAGES_POLICY
    baseline: str | None = None                    # stamp --baseline: the drift baseline's URL

    @classmethod
    def of(cls, data: Mapping[str, str]) -> "Declaration":
        """The declaration whose keys are ``data``'s (a file's, or the tags' without their
        prefix); a key that is none of the fields is the backend's."""
        named = {f.name for f in fields(cls)} - {"backend"}
        return cls(**{k: v for k, v in data.items() if k in named},
                   backend={k: v for k, v in data.items() if k not in named})

    @classmethod
    def stamped(cls, triple: Triple, extra: Mapping[str, str] | None = None) -> "Declaration":
        """What stamp declares: ``triple`` and ``extra`` (the backend's values and the rest)."""
        return cls.of({**triple.as_dict(), **(extra or {})})

    def to_dict(self) -> dict[str, str]:
        """Its keys in the file's order (the backend's values after the triple); none of an
        absent part."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "backend":
                out.update(value)
            elif value is not None:
                out[f.name] = value
        return out

    def __getitem__(self, key: str) -> str:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    def parts(self) -> dict[str, str | None]:
        return {k: getattr(self, k) for k in PARTS}

    def missing(self) -> list[str]:
        return [k for k, v in self.parts().items() if v is None]


def typed(declared: Mapping[str, str]) -> Declaration:
    """``declared`` as a :class:`Declaration` (a plain mapping of its keys: a test's, a caller's)."""
    return declared if isinstance(declared, Declaration) else Declaration.of(declared)


def sidecar_path(model_path: str | Path) -> Path:
    return Path(f"{model_path}{SIDECAR_SUFFIX}")


def read_sidecar(model_path: str | Path) -> Declaration | None:
    """The declaration in the model's sidecar: the triple's parts and whatever else the backend
    declares (``precision``, ``tensorrt_version``, …), all as strings. ``model_path`` may be a
    store URL: the sidecar is read beside the model in the store."""
    if isinstance(model_path, str) and local_path(model_path) is None:
        url = f"{model_path}{SIDECAR_SUFFIX}"
        try:
            fs, in_store = url_to_fs(url)
            text = fs.cat_file(in_store).decode("utf-8", errors="replace")
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot read the declaration {url}: {one_line(exc)}") from None
        return _declaration(text, url)
    path = sidecar_path(model_path)
    if not path.is_file():
        return None
    return _declaration(path.read_text(), str(path))


def _declaration(text: str, where: str) -> Declaration:
    try:
        data = json.loads(text)
    except ValueError:
        raise ContractError(f"{where} is not valid JSON", path=where, remedies=[STAMP]) from None
    if not isinstance(data, dict):
        raise ContractError(f"{where} is not a declaration (a JSON object)", path=where,
                            remedies=[STAMP])
    return Declaration.of({str(k): str(v) for k, v in data.items() if isinstance(v, (str, int, float))})


def write_sidecar(model_path: str | Path, triple: Triple,
                  extra: Mapping[str, str] | None = None) -> Path | str:
    """Write the declaration beside the model (in its store, for a store URL); where it went."""
    text = json.dumps(Declaration.stamped(triple, extra).to_dict(), indent=2) + "\n"
    if isinstance(model_path, str) and local_path(model_path) is None:
        url = f"{model_path}{SIDECAR_SUFFIX}"
        try:
            fs, in_store = url_to_fs(url)
            fs.pipe_file(in_store, text.encode())   # one PUT: a reader never sees half of it
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot write the declaration {url}: {one_line(exc)}") from None
        return url
    path = sidecar_path(local_path(str(model_path)) or model_path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader never sees half a declaration
    return path


def declaration_from_tags(tags: Mapping[str, str]) -> Declaration | None:
    found = {k[len(TAG_PREFIX):]: v for k, v in tags.items() if k.startswith(TAG_PREFIX)}
    return Declaration.of(found) if any(k in found for k in PARTS) else None


def declaration_tags(triple: Triple, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    return {TAG_PREFIX + k: v for k, v in Declaration.stamped(triple, extra).to_dict().items()}


# -- the check ---------------------------------------------------------------------------------

def check_contract(model: str, declared: Mapping[str, str] | None, found: Triple,
                   spec_version: str | None = None, options: Mapping[str, str] | None = None,
                   implied: Mapping[str, str] | None = None) -> None:
    """Raise ContractError unless ``declared`` matches what the job would run.

    Args:
        model: the model's URI, for the message.
        declared: the declaration (sidecar or tags), or None if there is none.
        found: the triple computed from the model bytes, the job's schema and preprocessing;
            its ``model_version`` is the declared one (the bytes cannot say their version).
        spec_version: ``model.version`` from the job spec, if set.
        options: the job's values of the backend's declared options (``precision``), which must
            equal the declared ones.
        implied: what a declaration that lacks one of those options means by it (a declaration
            written before the backend declared ``precision``: fp32); an option neither
            declared nor implied is a mismatch.
    """
    if declared is None:
        raise ContractError(
            f"{model} has no declaration (expected {sidecar_path(model).name} or batchinfer.* "
            f"model-version tags)", path=model, remedies=[Remedy(Action.STAMP, subject=model)])
    declared = typed(declared)
    missing = declared.missing()
    if missing:
        raise ContractError(f"{model}: declaration lacks {', '.join(missing)}", path=model,
                            field=missing[0], remedies=[STAMP])
    expected = declared.parts()
    actual: dict[str, str | None] = dict(found.as_dict())
    if spec_version is not None:
        actual["model_version"] = spec_version
    bad = [k for k in PARTS if expected[k] != actual[k]]
    for key, value in (options or {}).items():
        stamped = declared.backend.get(key, (implied or {}).get(key))
        if stamped != value:
            raise ContractError(
                f"contract mismatch for {model}: model.options.{key} is {value} but the model was "
                f"stamped for {stamped or '(not declared)'} ({key} changes predictions; run with "
                f"the declared {key})", path=model, field=f"model.options.{key}",
                remedies=[FOR_THIS_ONE])
    if not bad:
        return
    parts = []
    for k in PARTS:
        if k in bad:
            parts.append(f"{k} declared {expected[k]} found {actual[k]}")
        else:
            parts.append(f"{k} ok ({(expected[k] or '')[:16]})")
    hint = ("the model file changed since it was stamped" if "model_digest" in bad
            else "re-stamp the model for this job, or use the schema/preprocessing it was stamped with")
    raise ContractError(f"contract mismatch for {model}: " + "; ".join(parts) + f" ({hint})")


def check_explain(model: str, declared: Mapping[str, str], wanted: str | None) -> None:
    """Raise ContractError unless the job's ``explain`` (its declared value, or None without
    one) is what the model was stamped with (the declaration's ``explain``; none when absent):
    an explainer that is not versioned with the model explains another model (contract §6
    "Explanations")."""
    stamped = typed(declared).explain
    if stamped == wanted:
        return
    raise ContractError(
        f"contract mismatch for {model}: the job's explain is {wanted or '(none)'} but the model "
        f"was stamped with {stamped or '(no explain)'} (run with the declared explain)",
        path=model, field="explain", remedies=[FOR_THIS_ONE])


# -- the code behind the triple's names ----------------------------------------------------------

def check_declared_code(model: str, declared: Mapping[str, str], schema_ref: str,
                        schema_sha256: str, next_schema: str, packages: str) -> list[str]:
    """Compare what the declaration records of the code behind the triple's names — the schema
    version's source (``schema_sha256``) and the installed packages the preprocessing imports
    (``preprocess_packages``) — with what would run now.

    Args:
        model: the model's URI, for the messages.
        declared: the declaration, already checked by :func:`check_contract`.
        schema_sha256: the sha256 of the job's schema version's LF source now.
        next_schema: ``name@N+1``, where a changed schema should be published.
        packages: the packages the preprocessing imports now, as ``preprocess_packages`` says them.

    Returns:
        Warning lines: a declaration older than ``schema_sha256``; packages that differ under
        the ``warn`` policy.

    Raises:
        ContractError: the schema's source changed since stamping (locked or not), the packages
            differ under the ``refuse`` policy, or the policy is unknown.
    """
    declared = typed(declared)
    warnings = []
    stamped = declared.schema_sha256
    if stamped is None:
        warnings.append(f"{model}: its declaration records no schema_sha256 (stamped by an older "
                        f"batchinfer or by hand), so an edit of schema {schema_ref} after stamping "
                        f"goes unnoticed unless the version is in lock.json: re-stamp the model")
    elif stamped != schema_sha256:
        raise ContractError(
            f"contract mismatch for {model}: schema {schema_ref} changed since the model was stamped "
            f"(its source has sha256 {schema_sha256[:12]}…, the declaration says {stamped[:12]}…): "
            f"restore it, or save the change as {next_schema}, publish it (`batchinfer schema "
            f"publish {next_schema}`) and re-stamp the model for it")
    if declared.preprocess_packages is None:   # stamped before packages were recorded: nothing to compare
        return warnings
    policy = declared.preprocess_packages_policy
    if policy is None:
        policy = "warn"
    if policy not in PACKAGE_POLICIES:
        raise ContractError(f"{model}: its declaration has {PACKAGES_POLICY} {policy!r}, not one of "
                            f"{', '.join(PACKAGE_POLICIES)}", path=model, field=PACKAGES_POLICY,
                            remedies=[Remedy(Action.STAMP, "with a packages policy of warn or refuse")])
    differ = package_differences(declared.preprocess_packages, packages)
    if not differ:
        return warnings
    what = "; ".join(differ)
    if policy == "refuse":
        raise ContractError(
            f"contract mismatch for {model}: packages the preprocessing imports differ from the "
            f"declaration ({what}) and it was stamped with --packages refuse: install the stamped "
            f"versions, or re-stamp the model with these")
    warnings.append(f"{model}: packages the preprocessing imports differ from the declaration "
                    f"({what}), so predictions may differ: to accept them, re-stamp the model "
                    f"(stamped with the refuse packages policy, a difference is exit 3)")
    return warnings


def package_differences(declared: str, installed: str) -> list[str]:
    """``"numpy stamped 2.4.6, installed 2.4.7"`` for each package whose version differs between
    two ``preprocess_packages`` values (a package on one side only included)."""
    def versions(text: str) -> dict[str, str]:
        return dict(item.partition("==")[::2] for item in text.split())

    a, b = versions(declared), versions(installed)
    return [f"{name} stamped {a.get(name, '(none)')}, installed {b.get(name, '(not found)')}"
            for name in sorted(a.keys() | b.keys()) if a.get(name) != b.get(name)]
