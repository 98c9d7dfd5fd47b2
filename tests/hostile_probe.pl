# What the hostile suite runs inside a sandbox as root, on perl-base's
# syscall(): the system calls that reach the kernel's shared surfaces. One
# answer a line, tab separated: "accepted" or the errno's name.
# Usage: perl hostile_probe.pl HOST_PID (a host process to try to trace).
use strict;
use warnings;
use Errno;

sub answer {
    my ($result) = @_;
    return "accepted" if $result >= 0;
    for my $name (keys %!) {
        return $name if $!{$name};
    }
    return "errno" . ($! + 0);
}

# syscall() may write through a string argument: each gets a copy of its own
# (a literal is read-only).
sub call {
    my @args = @_;
    return syscall($args[0], @args[1 .. $#args]);
}

my $host = $ARGV[0] + 0;
open(my $null, "<", "/dev/null") or die "/dev/null: $!";
my $nullfd = fileno($null);
mkdir "/tmp/hostile-mnt";
my $bpf = pack("L4", 2, 4, 4, 1) . ("\0" x 112);     # an array map, 1 entry
my $perf = pack("LL", 1, 112) . ("\0" x 104);       # PERF_TYPE_SOFTWARE, cpu clock
my @calls = (
    ["mount", "tmpfs", sub { call(165, "none", "/tmp/hostile-mnt", "tmpfs", 0, 0) }],
    ["mount", "proc", sub { call(165, "proc", "/tmp/hostile-mnt", "proc", 0, 0) }],
    ["mount", "bind /", sub { call(165, "/", "/tmp/hostile-mnt", 0, 4096, 0) }],
    ["mount", "fsopen", sub { call(430, "tmpfs", 0) }],
    ["mount", "open_tree /", sub { call(428, -100, "/", 1) }],
    ["call", "ptrace attach (host pid)", sub { call(101, 16, $host, 0, 0) }],
    ["call", "ptrace seize (host pid)", sub { call(101, 0x4206, $host, 0, 0) }],
    ["call", "init_module", sub { call(175, 0, 0, "") }],
    ["call", "finit_module", sub { call(313, $nullfd, "", 0) }],
    ["call", "delete_module", sub { call(176, "loop", 0) }],
    ["call", "kexec_load", sub { call(246, 0, 0, 0, 0) }],
    ["call", "kexec_file_load", sub { call(320, $nullfd, $nullfd, 0, "", 4) }],
    ["call", "keyctl", sub { call(250, 1, 0) }],     # KEYCTL_JOIN_SESSION_KEYRING
    ["call", "add_key", sub { call(248, "user", "hostile", "x", 1, -3) }],
    ["call", "request_key", sub { call(249, "user", "hostile", 0, -3) }],
    ["call", "bpf", sub { call(321, 0, $bpf, 128) }],
    ["call", "perf_event_open", sub { call(298, $perf, 0, -1, -1, 0) }],
    ["call", "userfaultfd", sub { call(323, 0) }],
    ["call", "unshare user namespace", sub { call(272, 0x10000000) }],
    ["call", "unshare mount namespace", sub { call(272, 0x00020000) }],
);
for my $call (@calls) {
    my ($kind, $name, $try) = @$call;
    $! = 0;
    my $said = answer($try->());
    # A mount let through is undone at once (the sandbox's own, in any case).
    syscall(166, "/tmp/hostile-mnt", 2) if $kind eq "mount" && $said eq "accepted";
    print "$kind\t$name\t$said\n";
}
