// Package modcheck holds tests of the module's hygiene, seen from a user's
// side:
//
//   - a new module that imports every public package of sagaflow must not
//     find testcontainers-go, Docker's or moby's modules in its build list
//     (`go list -m all`). Those belong to the test harness's container
//     fallback, which lives in a module of its own
//     (internal/pgtest/pgcontainer). The test builds such a module in a
//     temporary directory, with a replace directive pointing at this
//     checkout; when a module is missing from the module cache and the
//     module proxy cannot be reached, it skips and says so;
//   - go.mod's go directive is the newest one among the dependencies, no
//     newer, so that users are not made to upgrade Go for nothing.
package modcheck
