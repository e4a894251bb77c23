"""The launcher, the top of the system: the `zeroserve` click commands (main.py, the group;
one module per command group: serve, gateway, worker, admin, debug, keys, check; the flags
in params.py and options.py, turned into configs by configs.py and back into a child's flags
by child_args.py), `serve`'s supervisor of its child processes (supervisor.py, children.py),
the admin API's client (admin_client.py) and the harness the scripts and tests start servers
with (harness.py). It may import every other package; nothing of the product imports it."""
