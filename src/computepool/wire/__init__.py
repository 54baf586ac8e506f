"""The HTTP API's messages, one pydantic model each (what goes in refuses unknown fields), shared by
the server that checks them, the client and the SDK that send them and the agent: one definition of
each wire type, no copy with other names anywhere."""
