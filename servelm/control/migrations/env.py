"""Alembic's environment for the control-plane database.

servelm.control.schema runs the migrations and hands this script an open connection, already in the
transaction that holds the migration lock (so two servers starting together never both migrate). Alembic's
own command line is not wired: use `servelm db upgrade` / `servelm db current`.
"""

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("the control database is migrated with `servelm db upgrade` (servelm.control.schema), "
                       "which opens the database and passes its connection here")
# SQLite alters a table by copying it (batch mode); PostgreSQL alters it in place
context.configure(connection=connection, target_metadata=None,
                  render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():  # a no-op inside the caller's transaction
    context.run_migrations()
