"""hutch's commands as data: the text of ``hutch --help``, where each command
lives and its line there. Plain data, importing nothing: ``hutch --help`` is
printed from it with no CLI library loaded (:mod:`.main`), and the click
group that runs the commands is built from it (:mod:`._app`), so the two
cannot say different things (a test prints both and compares them).
"""

from __future__ import annotations

#: The text of ``hutch --help`` (and of the group click builds).
HELP = """\
hutch: sandboxes for AI agents. Talks to `hutch serve` at HUTCH_URL
(default http://127.0.0.1:8787) with the token in HUTCH_TOKEN.

Exit codes scripts can rely on:

    0  done
    1  any other error
    2  bad usage or invalid argument (invalid_argument, timeout_too_large, invalid_state)
    3  not found (no such sandbox, workspace or file)
    4  sandbox unavailable or expired (sandbox_unavailable, idle_timeout, ...)
    5  unauthorized (missing or wrong token)

`hutch exec` exits with the command's own exit code."""

#: ``hutch --version``'s line in the help.
VERSION_HELP = "Print hutch's version and exit."

#: What the usage line says after the program's name.
USAGE = "[OPTIONS] COMMAND [ARGS]..."

#: The options panel of ``hutch --help``: the group's own options, then the
#: help option click gives every command (its text as click words it).
OPTIONS = [("--version", VERSION_HELP), ("--help", "Show this message and exit.")]

#: Every command of ``hutch``, in the order its help lists them: where it is
#: (``module:name`` under ``hutch.cli``) and its line in ``hutch --help`` (the
#: first paragraph of its own help; a test keeps them the same). A command's
#: module is imported only when that command runs or shows its own help.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("serve:serve", "Run the daemon: the HTTP API, the state store, the timers."),
    "demo": ("serve:demo",
             "Show hutch working in-process, with no daemon: a local sandbox in a temp dir."),
    "ls": ("sandboxes:list_sandboxes",
           "List sandboxes, one line each: state, age, idle time and time to the deadline."),
    "events": ("sandboxes:events",
               "What happened to a sandbox or workspace, and why (reaped, failed, adopted...)."),
    "create": ("sandboxes:create",
               "Create a sandbox. Flags beat hutch.toml, which beats the daemon's defaults."),
    "exec": ("run:exec_",
             "Run a command in a sandbox, streaming its output; exit with its exit code."),
    "ref": ("refs:ref", "Hand out a ref to a sandbox you own: a credential for it alone."),
    "refs": ("refs:refs", "The refs of a sandbox that still work, one line each."),
    "attach": ("run:attach",
               "Run a command in the sandbox a ref names, as an attached session."),
    "shell": ("run:shell", "An interactive shell in a sandbox (bash, else sh), on a "
              "pseudo-terminal inside it; exit with the shell's exit code."),
    "start": ("processes:start", "Start a command in the background in a sandbox; print its id."),
    "stdin": ("processes:stdin", "Send our standard input, as it comes, to a background command "
              "started with --keep-stdin; at its end, close the command's (unless --keep-open)."),
    "wait": ("processes:wait", "Wait for a background command to end; print its output and "
             "exit with its exit code."),
    "cp": ("files:cp", "Copy a file or a directory into or out of a sandbox."),
    "mkdir": ("fileops:mkdir",
              "Make a directory in a sandbox (relative to its working directory)."),
    "mv": ("fileops:mv", "Move (rename) a file or a directory inside a sandbox."),
    "watch": ("fileops:watch", "Print what changes below a directory of a sandbox, a line an "
              "event: created, written, removed or renamed, then the path (and the new path)."),
    "pause": ("sandboxes:pause",
              "Hold a sandbox as it is (processes and memory stay, no CPU)."),
    "suspend": ("sandboxes:suspend", "Free a sandbox's memory, keeping its state on disk."),
    "resume": ("sandboxes:resume", "Bring a paused or suspended sandbox back."),
    "kill": ("sandboxes:kill", "End a sandbox and release everything it holds."),
    "set-timeout": ("sandboxes:set_timeout",
                    "Make a sandbox's deadline now + SECONDS; prints it as Unix time."),
    "fork": ("snapshots:fork", "Snapshot a sandbox and start N independent branches from it."),
    "ensure": ("definitions:ensure", "The sandbox of a thread for a definition: resumed, "
               "restored from its setup snapshot, or created with setup run. Prints its id "
               "and each step."),
    "definitions": ("definitions:definitions",
                    "The daemon's sandbox definitions, one line each."),
    "complete": ("definitions:complete",
                 "A thread's run ended: its sandbox is destroyed if the definition says so."),
    "mcp": ("mcp_server:mcp", "Serve a hutch sandbox as MCP tools to a coding assistant "
            "(stdio, or --http)."),
    "token": ("tokens:token",
              "Print the daemon's token (or a ref), e.g. as E2B_API_KEY for the E2B SDKs."),
    "workspace": ("workspaces:workspace", "Named workspaces that outlive the daemon."),
    "pool": ("pools:pool", "Warm pools: sandboxes made ahead, which a create takes ready."),
    "image": ("images:image",
              "Images: environments built once, used by name by docker and bubblewrap."),
    "snapshot": ("snapshots:snapshot", "Snapshots of sandboxes, as a lineage tree."),
}
