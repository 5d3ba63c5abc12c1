// Package store owns every SQL statement sagaflow runs against PostgreSQL, and
// the migrator that creates its tables.
//
// All statements are qualified with a configurable schema, validated by
// [ValidateSchema] and quoted with [pgx.Identifier], so one database can hold
// several independent sagaflow installations and a schema name can never
// inject SQL.
//
// # Migrations
//
// [Migrate] applies the embedded migrations in order under a PostgreSQL
// advisory lock, each in its own transaction, recording them in the
// sagaflow_migrations table of the schema. It is idempotent and safe to run
// from many processes at once:
//
//	if _, err := migrations.Migrate(ctx, pool, "sagaflow"); err != nil {
//		return err
//	}
//
// Teams that run their own migration tool print the SQL instead with
// [MigrationSQL] (or `sagaflow migrate --print`) and apply it themselves.
//
// # Statements
//
// [Store] holds the prepared text of each statement for one schema. Its
// methods take a [DBTX], which a *pgxpool.Pool, a *pgx.Conn and a pgx.Tx all
// satisfy, so callers choose the transaction.
package store
