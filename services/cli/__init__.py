"""The command line: `specserve` and its subcommands (main), `specserve up` (up), and the load generator
behind `specserve bench` (loadgen).

May import the services and `specserve.shared`; nothing else imports it.
"""
