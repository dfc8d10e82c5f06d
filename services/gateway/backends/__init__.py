"""The model services behind the gateway: the replica pool, the executor of service calls, discovery."""
