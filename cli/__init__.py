"""The launcher, the top of the system: the `zeroserve` click commands (cli/main.py), `serve`'s
supervisor of its child processes (supervisor.py, children.py), the admin API's client
(admin_client.py) and the harness the scripts and tests start servers with (harness.py). It
may import every other package; nothing of the product imports it."""
