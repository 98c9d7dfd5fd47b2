"""What the hostile suite runs inside a sandbox as root, on the image's
python3 (python3-minimal: no ctypes, no json), for the file side of the
kernel: every writable file under /proc/sys and /sys, the SysRq trigger,
device nodes. System calls are hostile_probe.pl's. One answer a line, tab
separated.

Nothing it does changes the host even where it is let through: a setting is
written with the value it already has, a write-only file (the SysRq trigger
among them) is only opened, never written, and so is each of a pair of
settings where writing one resets the other whatever the value (writing
vm/overcommit_kbytes sets vm/overcommit_ratio to 0); a device node made in
/tmp is removed at once.
"""

import errno
import os
import stat

NAMED = ("kernel/core_pattern", "kernel/randomize_va_space", "kernel/panic_on_oops",
         "vm/overcommit_memory", "fs/suid_dumpable", "fs/protected_symlinks")

#: Settings whose write handler resets another one, even when the value
#: written is the one already there: only opened for writing.
COUPLED = {f"/proc/sys/vm/{name}" for name in (
    "overcommit_kbytes", "overcommit_ratio", "dirty_bytes", "dirty_ratio",
    "dirty_background_bytes", "dirty_background_ratio",
)}


def errname(exc):
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def write_own_value(path, readable):
    """Whether ``path`` took a write of its own value (a write-only file:
    whether it opened for writing; nothing is written to it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        value = None
        if readable and path not in COUPLED:
            try:
                with open(path, "rb") as fh:
                    value = fh.read()
            except OSError:
                value = None
        if value is None:
            return True
        try:
            os.write(fd, value)
        except OSError:
            return False
        return True
    finally:
        os.close(fd)


def knobs():
    tried = 0
    for top in ("/proc/sys", "/sys"):
        for dirpath, _dirs, files in os.walk(top):  # never follows links
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o222:
                    continue
                tried += 1
                if write_own_value(path, st.st_mode & 0o444):
                    print(f"knob-accepted\t{path}")
    print(f"knobs-tried\t{tried}")


def named():
    for name in NAMED:
        took = write_own_value(f"/proc/sys/{name}", True)
        print(f"named\t{name}\t{'accepted' if took else 'refused'}")


def sysrq():
    answer = "absent"
    if os.path.lexists("/proc/sysrq-trigger"):
        try:
            os.close(os.open("/proc/sysrq-trigger", os.O_WRONLY))
            answer = "accepted"
        except OSError as exc:
            answer = errname(exc)
    print(f"sysrq\t{answer}")


def mknod():
    path = f"/tmp/hostile-node-{os.getpid()}"
    for kind, mode, dev in (("char 1:3", stat.S_IFCHR, os.makedev(1, 3)),
                            ("block 7:0", stat.S_IFBLK, os.makedev(7, 0))):
        try:
            os.mknod(path, mode | 0o600, dev)
        except OSError as exc:
            answer = errname(exc)
        else:
            os.unlink(path)
            answer = "accepted"
        print(f"mknod\t{kind}\t{answer}")


with open("/proc/self/uid_map") as fh:
    print("uid_map\t" + " ".join(fh.read().split()))
knobs()
named()
sysrq()
mknod()
