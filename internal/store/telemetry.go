package store

import (
	"context"
	"fmt"
)

// StatusCount is how many sagas of one name have one status.
type StatusCount struct {
	Name   string
	Status string
	Count  int64
}

// CountSagas counts the sagas by name and status, in one statement.
func (s *Store) CountSagas(ctx context.Context, db DBTX) ([]StatusCount, error) {
	rows, err := db.Query(ctx, `SELECT saga_name, status, count(*) FROM `+quoteSchema(s.schema)+`.saga_instances GROUP BY 1, 2 ORDER BY 1, 2`)
	if err != nil {
		return nil, fmt.Errorf("store: count sagas: %w", err)
	}
	defer rows.Close()
	var out []StatusCount
	for rows.Next() {
		var c StatusCount
		if err := rows.Scan(&c.Name, &c.Status, &c.Count); err != nil {
			return nil, fmt.Errorf("store: count sagas: %w", err)
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: count sagas: %w", err)
	}
	return out, nil
}
