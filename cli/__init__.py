"""The launcher, the top of the system: the `zeroserve` click commands (cli/main.py), `serve`'s
supervisor of its child processes (supervisor.py, children.py) and the admin API's client
(admin_client.py). It may import every other package; nothing imports it."""
