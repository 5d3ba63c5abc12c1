// Package modcheck holds a test of the module's hygiene, seen from a user's
// side: a new module that imports every public package of sagaflow must
// not find testcontainers-go, Docker's or moby's modules in its build list
// (`go list -m all`). Those belong to the test harness's container fallback,
// which lives in a module of its own (internal/pgtest/pgcontainer).
//
// The test builds such a module in a temporary directory, with a replace
// directive pointing at this checkout. It needs the go command and the
// module cache; when a module is missing from the cache and the module
// proxy cannot be reached, it skips and says so.
package modcheck
