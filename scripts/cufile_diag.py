"""Diagnose cuFile on this machine: driver open and handle registration through ctypes, with the
library actually loaded, the error enum names from cufile.h and cuFile's own log."""

import ctypes
import glob
import os
import re

import torch

torch.zeros(1, device="cuda")
lib = ctypes.CDLL("libcufile.so.0")


class Err(ctypes.Structure):
    _fields_ = [("err", ctypes.c_int), ("cu_err", ctypes.c_int)]


class U(ctypes.Union):
    _fields_ = [("fd", ctypes.c_int), ("handle", ctypes.c_void_p)]


class Descr(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handle", U), ("fs_ops", ctypes.c_void_p)]


lib.cuFileDriverOpen.restype = Err
lib.cuFileHandleRegister.restype = Err
print("cuFileDriverOpen:", lib.cuFileDriverOpen().err)
for name, flags in [("O_DIRECT", os.O_RDWR | os.O_CREAT | os.O_DIRECT), ("buffered", os.O_RDWR | os.O_CREAT)]:
    fd = os.open("/tmp/cufile-diag.bin", flags, 0o644)
    d = Descr(1, U(fd=fd), None)
    fh = ctypes.c_void_p()
    e = lib.cuFileHandleRegister(ctypes.byref(fh), ctypes.byref(d))
    print(f"cuFileHandleRegister({name}): err={e.err} cu_err={e.cu_err}")
    os.close(fd)
for line in open("/proc/self/maps"):
    if "cufile" in line:
        print("loaded:", line.split()[-1])
        break
hdrs = glob.glob("/usr/local/cuda*/include/cufile.h") + glob.glob("/usr/include/cufile.h")
if hdrs:
    txt = open(hdrs[0]).read()
    for m in re.finditer(r"(CU_FILE_\w+)\s*=\s*CUFILEOP_BASE_ERR\s*\+\s*(\d+)", txt):
        if int(m.group(2)) in (20, 26, 27, 28, 33, 34):
            print("enum", 5000 + int(m.group(2)), m.group(1))
for cfg in ["/etc/cufile.json", *glob.glob("/usr/local/cuda*/gds/cufile.json")]:
    if os.path.exists(cfg):
        for line in open(cfg):
            if "compat" in line.lower() and not line.strip().startswith("//"):
                print(cfg, line.strip())
for log in ["cufile.log", "/tmp/cufile.log"]:
    if os.path.exists(log):
        print("---", log)
        print("".join(open(log).readlines()[-15:]))
