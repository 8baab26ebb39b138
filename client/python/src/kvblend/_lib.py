"""Loading libkvblend and its C declarations (client/include/kvblend.h), for ctypes.

Every structure here mirrors one of kvblend.h field for field; the test suite
compares their sizes and offsets with the C compiler's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

from .blend import metrics as _metrics

HASH_LEN = 32
NAME_MAX = 64

DTYPES = {"f16": 1, "bf16": 2, "f32": 3}
ROPE_STYLES = {"neox": 0, "gptj": 1}
#: The daemon's metric codes (kvb_fuse_params.metric), from kvblend.blend.metrics.
METRICS = _metrics.DAEMON_CODES


class KvbModel(ctypes.Structure):
    """struct kvb_model."""

    _fields_ = [
        ("name", ctypes.c_char * (NAME_MAX + 1)),
        ("num_layers", ctypes.c_uint32),
        ("num_kv_heads", ctypes.c_uint32),
        ("head_dim", ctypes.c_uint32),
        ("dtype", ctypes.c_int),
        ("rope_theta", ctypes.c_double),
        ("rope_style", ctypes.c_int),
        ("rotary_dim", ctypes.c_uint32),
        ("scaling", ctypes.c_int),
        ("factor", ctypes.c_double),
        ("low_freq_factor", ctypes.c_double),
        ("high_freq_factor", ctypes.c_double),
        ("original_max_pos", ctypes.c_uint32),
        ("beta_fast", ctypes.c_double),
        ("beta_slow", ctypes.c_double),
        ("max_pos", ctypes.c_uint32),
        ("k_pre_rope", ctypes.c_int),
        ("store_codec", ctypes.c_int),
        ("store_group", ctypes.c_uint32),
    ]


class KvbModelLayers(ctypes.Structure):
    """struct kvb_model_layers (KVBLEND_1.8)."""

    _fields_ = [("rope_local_theta", ctypes.c_double), ("full_every", ctypes.c_uint32)]


class KvbChunkInfo(ctypes.Structure):
    """struct kvb_chunk_info."""

    _fields_ = [
        ("hash", ctypes.c_uint8 * HASH_LEN),
        ("found", ctypes.c_int),
        ("num_tokens", ctypes.c_uint32),
        ("base_pos", ctypes.c_uint32),
        ("num_layers", ctypes.c_uint32),
        ("raw_bytes", ctypes.c_uint64),
        ("stored_bytes", ctypes.c_uint64),
    ]


class KvbLayers(ctypes.Structure):
    """struct kvb_layers."""

    _fields_ = [
        ("layer_begin", ctypes.c_uint32),
        ("layer_end", ctypes.c_uint32),
        ("tensor_bytes", ctypes.c_size_t),
        ("k", ctypes.POINTER(ctypes.c_void_p)),
        ("v", ctypes.POINTER(ctypes.c_void_p)),
        ("info", KvbChunkInfo),
        ("frames_", ctypes.c_void_p),
    ]


class KvbStat(ctypes.Structure):
    """struct kvb_stat."""

    _fields_ = [("name", ctypes.c_char * 64), ("value", ctypes.c_double)]


class KvbConnectOpts(ctypes.Structure):
    """struct kvb_connect_opts."""

    _fields_ = [
        ("timeout_ms", ctypes.c_int),
        ("no_shm", ctypes.c_int),
        ("shm_size", ctypes.c_uint64),
        ("server_key", ctypes.c_char_p),
        ("client_secret_key", ctypes.c_char_p),
    ]


class KvbSegment(ctypes.Structure):
    """struct kvb_segment."""

    _fields_ = [
        ("fresh", ctypes.c_int),
        ("hash", ctypes.c_uint8 * HASH_LEN),
        ("pos", ctypes.c_uint32),
        ("count", ctypes.c_uint32),
    ]


class KvbFuseParams(ctypes.Structure):
    """struct kvb_fuse_params."""

    _fields_ = [
        ("check_layers", ctypes.POINTER(ctypes.c_uint32)),
        ("ratios", ctypes.POINTER(ctypes.c_double)),
        ("n_checks", ctypes.c_size_t),
        ("metric", ctypes.c_int),
    ]


class KvbKvLayout(ctypes.Structure):
    """struct kvb_kv_layout."""

    _fields_ = [
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("layer_stride", ctypes.c_size_t),
        ("token_stride", ctypes.c_size_t),
        ("head_stride", ctypes.c_size_t),
        ("page_tokens", ctypes.c_uint32),
        ("page_stride", ctypes.c_size_t),
        ("pages", ctypes.POINTER(ctypes.c_uint32)),
        ("n_pages", ctypes.c_size_t),
    ]


class KvbKvStrides(ctypes.Structure):
    """struct kvb_kv_strides (ABI 1.1)."""

    _fields_ = [
        ("token_stride", ctypes.c_size_t),
        ("head_stride", ctypes.c_size_t),
        ("dim_stride", ctypes.c_size_t),
    ]


class KvbDeviceMem(ctypes.Structure):
    """struct kvb_device_mem (ABI 1.4)."""

    _fields_ = [
        ("base", ctypes.c_void_p),
        ("bytes", ctypes.c_size_t),
        ("ipc_handle", ctypes.c_uint8 * 64),
        ("pci", ctypes.c_char * 32),
        ("progress", ctypes.c_void_p),
    ]


class KvbLandOpts(ctypes.Structure):
    """struct kvb_land_opts (ABI 1.4)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("k_strides", ctypes.POINTER(KvbKvStrides)),
        ("device", ctypes.POINTER(KvbDeviceMem)),
        ("head_begin", ctypes.c_uint32),
        ("head_count", ctypes.c_uint32),
    ]


class KvbGetOpts(ctypes.Structure):
    """struct kvb_get_opts (ABI 1.6)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("layer_begin", ctypes.c_uint32),
        ("layer_end", ctypes.c_uint32),
        ("rerotate", ctypes.c_int),
        ("pos", ctypes.c_uint32),
        ("head_begin", ctypes.c_uint32),
        ("head_count", ctypes.c_uint32),
    ]


HashArray = ctypes.c_uint8 * HASH_LEN
_P = ctypes.c_void_p
_HASH = ctypes.POINTER(ctypes.c_uint8)
_SZ = ctypes.c_size_t
_U32 = ctypes.c_uint32
_STR = ctypes.c_char_p
_INT = ctypes.c_int
_PSZ = ctypes.POINTER(ctypes.c_size_t)

# name: (restype, argtypes)
_PROTOTYPES = {
    "kvb_connect": (_INT, [_STR, ctypes.POINTER(KvbConnectOpts), ctypes.POINTER(_P), _STR, _SZ]),
    "kvb_close": (None, [ctypes.POINTER(_P)]),
    "kvb_set_timeout": (_INT, [_P, _INT]),
    "kvb_last_error": (_STR, [_P]),
    "kvb_last_code": (_INT, [_P]),
    "kvb_strerror": (_STR, [_INT]),
    "kvb_default_endpoint": (_STR, []),
    "kvb_ping": (_INT, [_P, _STR, _SZ]),
    "kvb_device_handle_from_fd": (_INT, [_P, _INT, _P]),
    "kvb_device_handle_from_fds": (_INT, [_P, _P, _P, _P, _SZ, _P]),
    "kvb_model_register": (_INT, [_P, ctypes.POINTER(KvbModel), ctypes.POINTER(_INT)]),
    "kvb_model_list": (_INT, [_P, ctypes.POINTER(ctypes.POINTER(KvbModel)), _PSZ]),
    "kvb_model_get": (_INT, [_P, _STR, ctypes.POINTER(KvbModel)]),
    "kvb_model_register_layers": (
        _INT,
        [_P, ctypes.POINTER(KvbModel), ctypes.POINTER(KvbModelLayers), ctypes.POINTER(_INT)],
    ),
    "kvb_model_get_layers": (
        _INT, [_P, _STR, ctypes.POINTER(KvbModel), ctypes.POINTER(KvbModelLayers)]
    ),
    "kvb_put": (_INT, [_P, _STR, _HASH, _INT, _U32, _U32, _P, _SZ, ctypes.POINTER(_INT)]),
    "kvb_get": (_INT, [_P, _STR, _HASH, _U32, _U32, _P, _SZ, ctypes.POINTER(KvbChunkInfo)]),
    "kvb_get_rerotated": (
        _INT,
        [_P, _STR, _HASH, _U32, _U32, _U32, _P, _SZ, ctypes.POINTER(KvbChunkInfo)],
    ),
    "kvb_get_opts": (
        _INT,
        [_P, _STR, _HASH, ctypes.POINTER(KvbGetOpts), _P, _SZ, ctypes.POINTER(KvbChunkInfo)],
    ),
    "kvb_get_layers": (
        _INT,
        [_P, _STR, _HASH, _U32, _U32, ctypes.POINTER(ctypes.POINTER(KvbLayers))],
    ),
    "kvb_layers_free": (None, [ctypes.POINTER(ctypes.POINTER(KvbLayers))]),
    "kvb_malloc_tune": (_INT, [_SZ]),
    "kvb_lookup": (_INT, [_P, _STR, _HASH, _SZ, ctypes.POINTER(KvbChunkInfo)]),
    "kvb_delete": (_INT, [_P, _STR, _HASH]),
    "kvb_pin": (_INT, [_P, _STR, _HASH, _U32]),
    "kvb_unpin": (_INT, [_P, _STR, _HASH]),
    "kvb_list": (_INT, [_P, _STR, ctypes.POINTER(ctypes.POINTER(KvbChunkInfo)), _PSZ]),
    "kvb_stats": (_INT, [_P, ctypes.POINTER(ctypes.POINTER(KvbStat)), _PSZ]),
    "kvb_cluster_check": (_INT, [_P, ctypes.POINTER(ctypes.POINTER(KvbStat)), _PSZ]),
    "kvb_shared_buffer": (_P, [_P, _SZ]),
    "kvb_fuse_open": (
        _INT,
        [
            _P,
            _STR,
            ctypes.POINTER(KvbSegment),
            _SZ,
            ctypes.POINTER(KvbFuseParams),
            ctypes.POINTER(_P),
            ctypes.POINTER(_HASH),
            _PSZ,
        ],
    ),
    "kvb_fuse_open_into_strided": (
        _INT,
        [
            _P,
            _STR,
            ctypes.POINTER(KvbSegment),
            _SZ,
            ctypes.POINTER(KvbFuseParams),
            ctypes.POINTER(KvbKvLayout),
            ctypes.POINTER(KvbKvStrides),
            ctypes.POINTER(_P),
            ctypes.POINTER(_HASH),
            _PSZ,
        ],
    ),
    "kvb_fuse_open_into_opts": (
        _INT,
        [
            _P,
            _STR,
            ctypes.POINTER(KvbSegment),
            _SZ,
            ctypes.POINTER(KvbFuseParams),
            ctypes.POINTER(KvbKvLayout),
            ctypes.POINTER(KvbLandOpts),
            ctypes.POINTER(_P),
            ctypes.POINTER(_HASH),
            _PSZ,
        ],
    ),
    "kvb_fuse_open_into_device": (
        _INT,
        [
            _P,
            _STR,
            ctypes.POINTER(KvbSegment),
            _SZ,
            ctypes.POINTER(KvbFuseParams),
            ctypes.POINTER(KvbKvLayout),
            ctypes.POINTER(KvbDeviceMem),
            ctypes.POINTER(_P),
            ctypes.POINTER(_HASH),
            _PSZ,
        ],
    ),
    "kvb_fuse_open_into": (
        _INT,
        [
            _P,
            _STR,
            ctypes.POINTER(KvbSegment),
            _SZ,
            ctypes.POINTER(KvbFuseParams),
            ctypes.POINTER(KvbKvLayout),
            ctypes.POINTER(_P),
            ctypes.POINTER(_HASH),
            _PSZ,
        ],
    ),
    "kvb_fuse_open_recompute": (
        _INT,
        [
            _P,
            _STR,
            ctypes.POINTER(KvbSegment),
            _SZ,
            _P,
            _SZ,
            ctypes.POINTER(KvbKvLayout),
            ctypes.POINTER(_P),
            ctypes.POINTER(_HASH),
            _PSZ,
        ],
    ),
    "kvb_fuse_attention": (_INT, [_P, _P, _P, _SZ]),
    "kvb_fuse_wait": (_INT, [_P, _P, _U32, _INT]),
    "kvb_fuse_check": (
        _INT,
        [_P, _P, _U32, _P, _SZ, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)), _PSZ],
    ),
    "kvb_fuse_check_deviation": (
        _INT,
        [_P, _P, _U32, _P, _SZ, ctypes.POINTER(ctypes.c_float)],
    ),
    "kvb_fuse_check_select": (
        _INT,
        [
            _P,
            _P,
            _U32,
            ctypes.POINTER(ctypes.c_float),
            ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)),
            _PSZ,
        ],
    ),
    "kvb_region_alloc": (_P, [_P, _SZ]),
    "kvb_region_free": (_INT, [_P, _P]),
    "kvb_fuse_tokens": (_U32, [_P]),
    "kvb_fuse_next_layer": (_U32, [_P]),
    "kvb_fuse_rows": (_SZ, [_P, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))]),
    "kvb_fuse_layer": (_INT, [_P, _P, _U32, _P, _P, _P, _P, ctypes.POINTER(_INT)]),
    "kvb_fuse_output": (_INT, [_P, ctypes.POINTER(_P), ctypes.POINTER(_P)]),
    "kvb_fuse_device": (_INT, [_P]),
    "kvb_fuse_on_device": (_INT, [_P]),
    "kvb_fuse_output_device": (_INT, [_P, ctypes.POINTER(_P), ctypes.POINTER(_P)]),
    "kvb_fuse_close": (
        _INT,
        [_P, ctypes.POINTER(_P), ctypes.POINTER(ctypes.POINTER(KvbStat)), _PSZ],
    ),
    "kvb_chunk_hash": (None, [ctypes.POINTER(ctypes.c_uint32), _SZ, _HASH]),
    "kvb_hash_parse": (_INT, [_STR, _HASH]),
    "kvb_hash_format": (None, [_HASH, _STR]),
    "kvb_dtype_size": (_SZ, [_INT]),
    "kvb_dtype_name": (_STR, [_INT]),
    "kvb_dtype_parse": (_INT, [_STR]),
    "kvb_rope_scaling_parse": (_INT, [_STR, ctypes.POINTER(KvbModel)]),
    "kvb_rope_scaling_format": (None, [ctypes.POINTER(KvbModel), _STR, _SZ]),
    "kvb_store_parse": (_INT, [_STR, ctypes.POINTER(KvbModel)]),
    "kvb_store_format": (None, [ctypes.POINTER(KvbModel), _STR, _SZ]),
}

#: The libkvblend ABI the declarations above (struct layouts included) are written for:
#: the library's soname number, and the version node its functions are bound to
#: (client/kvblend.map; the policy is at the top of kvblend.h).
_ABI = 1
_VERSION_NODE = f"KVBLEND_{_ABI}"
_SONAMES = (f"libkvblend.so.{_ABI}", "libkvblend.so")


def _candidates() -> list[str]:
    """Paths to try, in order: $KVBLEND_LIB, the bundled copy, the build tree, the system's."""
    env = os.environ.get("KVBLEND_LIB")
    if env:
        # An explicit choice is final: a wrong path must fail, not fall back silently.
        return [env]
    out = []
    # Built and bundled by the install (client/python/setup.py): kvblend/_libs/.
    bundled = Path(__file__).resolve().parent / "_libs" / _SONAMES[0]
    if bundled.exists():
        out.append(str(bundled))
    # Installed in place (pip install -e, or src/ on sys.path): the checkout's build/.
    src = Path(__file__).resolve().parent  # client/python/src/kvblend
    if len(src.parents) > 3 and (src.parents[3] / "client" / "include" / "kvblend.h").is_file():
        out.append(str(src.parents[3] / "build" / "lib" / "libkvblend.so"))
    found = ctypes.util.find_library("kvblend")
    if found:
        out.append(found)
    out.extend(_SONAMES)
    return out


def _abi_mismatch(lib: ctypes.CDLL) -> str | None:
    """Why lib is not of the ABI this package speaks, or None if it is.

    A library of another ABI may have every function this package calls and still lay
    out ``struct kvb_model`` differently (soname 0 did); its functions then carry no
    ``KVBLEND_1`` version, which ``dlvsym`` tells. Where the C library has no
    ``dlvsym`` the soname stands alone.
    """
    dlvsym = getattr(ctypes.CDLL(None), "dlvsym", None)
    if dlvsym is None:
        return None
    dlvsym.restype = ctypes.c_void_p
    dlvsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
    if dlvsym(lib._handle, b"kvb_connect", _VERSION_NODE.encode()):
        return None
    return f"not ABI {_ABI}: its functions lack version {_VERSION_NODE}; use libkvblend.so.{_ABI}"


def _load() -> ctypes.CDLL:
    tried = []
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            tried.append(f"{path} (absent)")
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path} ({e})")
            continue
        missing = [name for name in _PROTOTYPES if not hasattr(lib, name)]
        if missing:
            # An older libkvblend than this package: say so rather than fail on first use.
            tried.append(
                f"{path} (too old for this package: no {', '.join(missing[:3])}"
                f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''};"
                " rebuild or reinstall libkvblend)"
            )
            continue
        why = _abi_mismatch(lib)
        if why:
            tried.append(f"{path} ({why})")
            continue
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        lib.kvblend_path = path
        return lib
    raise ImportError(
        "kvblend: cannot load libkvblend; set KVBLEND_LIB to the path of libkvblend.so. "
        "Tried: " + "; ".join(tried)
    )


lib = _load()

# free() for the arrays libkvblend hands over with malloc(); the process's own allocator,
# which is the one libkvblend links against (libc, or an interposed one such as ASan's).
_libc = ctypes.CDLL(None)
free = _libc.free
free.restype = None
free.argtypes = [ctypes.c_void_p]
