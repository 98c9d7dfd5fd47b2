"""The seccomp filter every bubblewrap sandbox runs under, as classic BPF.

bubblewrap loads a compiled filter from a file descriptor (``--seccomp FD``);
this module compiles one without libseccomp. It is a deny list in the spirit
of Docker's default profile: the calls that reach kernel surfaces a sandboxed
agent has no use for (mounting, namespaces, modules, keyrings, BPF, perf,
io_uring, kexec, clock setting, terminal injection, taking another process's
descriptors) fail with EPERM; the rest
are allowed. Root inside is also an unprivileged host id (see :mod:`.userns`),
keeps only a few capabilities in its own user namespace, and has NoNewPrivs
set, so most of these would fail anyway: the filter refuses what root of a
user namespace could still do (make namespaces and mounts of its own, reach
keyrings, BPF, perf and userfaultfd) and shrinks what an exploit can reach.
"""

from __future__ import annotations

import errno
import platform
import struct

from ..._errors import ProviderError

# BPF instruction classes and fields (linux/filter.h, linux/bpf_common.h).
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06

_RET_ALLOW = 0x7FFF0000
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000

# struct seccomp_data: int nr; __u32 arch; __u64 ip; __u64 args[6].
_OFF_NR = 0
_OFF_ARCH = 4


def _arg_low(index: int) -> int:
    return 16 + 8 * index  # the low 32 bits, little-endian


_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000

#: x86_64 numbers of the calls refused outright (arch/x86/entry/syscalls).
_DENIED_X86_64 = {
    "ptrace": 101,
    "syslog": 103,
    "uselib": 134,
    "personality": 135,
    "vhangup": 153,
    "pivot_root": 155,
    "_sysctl": 156,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "sethostname": 170,
    "setdomainname": 171,
    "iopl": 172,
    "ioperm": 173,
    "create_module": 174,
    "init_module": 175,
    "delete_module": 176,
    "get_kernel_syms": 177,
    "query_module": 178,
    "quotactl": 179,
    "nfsservctl": 180,
    "lookup_dcookie": 212,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "clock_adjtime": 305,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "pidfd_getfd": 438,
    "mount_setattr": 442,
}
_IOCTL_X86_64 = 16
_CLONE_X86_64 = 56
_CLONE3_X86_64 = 435

#: ioctl requests that push input into a terminal (TIOCSTI) or reach the console.
_DENIED_IOCTLS = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX
#: Namespace flags clone may not take (CLONE_NEWUSER and the others).
_CLONE_NAMESPACE_FLAGS = 0x7E020000


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def _deny(nr: int, err: int = errno.EPERM) -> bytes:
    # if nr == k: return ERRNO(err); else fall through
    return _insn(_JEQ_K, 0, 1, nr) + _insn(_RET_K, 0, 0, _RET_ERRNO | err)


def compile_filter() -> bytes:
    """The filter program for this machine's architecture, as bwrap reads it."""
    machine = platform.machine()
    if machine not in ("x86_64", "amd64"):
        raise ProviderError(
            f"bubblewrap: hutch has no seccomp filter for {machine} yet; "
            "it will not start a sandbox without one"
        )
    eperm = _RET_ERRNO | errno.EPERM
    prog = [
        _insn(_LD_W_ABS, 0, 0, _OFF_ARCH),
        _insn(_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),
        _insn(_LD_W_ABS, 0, 0, _OFF_NR),
        # The x32 ABI reaches the same calls under other numbers: refuse it whole.
        _insn(_JGE_K, 0, 1, _X32_SYSCALL_BIT),
        _insn(_RET_K, 0, 0, eperm),
    ]
    prog.extend(_deny(nr) for nr in sorted(_DENIED_X86_64.values()))
    # clone3 passes its flags in memory a filter cannot read: ENOSYS makes libc
    # fall back to clone, whose flags it can.
    prog.append(_deny(_CLONE3_X86_64, errno.ENOSYS))
    # ioctl(fd, TIOCSTI | TIOCLINUX, ...) -> EPERM
    ioctl_checks = [_insn(_LD_W_ABS, 0, 0, _arg_low(1))]
    for request in _DENIED_IOCTLS:
        ioctl_checks.append(_insn(_JEQ_K, 0, 1, request))
        ioctl_checks.append(_insn(_RET_K, 0, 0, eperm))
    ioctl_checks.append(_insn(_RET_K, 0, 0, _RET_ALLOW))
    prog.append(_insn(_JEQ_K, 0, len(ioctl_checks), _IOCTL_X86_64))
    prog.extend(ioctl_checks)
    # clone(flags, ...) with a namespace flag -> EPERM
    clone_checks = [
        _insn(_LD_W_ABS, 0, 0, _arg_low(0)),
        _insn(_JSET_K, 0, 1, _CLONE_NAMESPACE_FLAGS),
        _insn(_RET_K, 0, 0, eperm),
        _insn(_RET_K, 0, 0, _RET_ALLOW),
    ]
    prog.append(_insn(_JEQ_K, 0, len(clone_checks), _CLONE_X86_64))
    prog.extend(clone_checks)
    prog.append(_insn(_RET_K, 0, 0, _RET_ALLOW))
    return b"".join(prog)
