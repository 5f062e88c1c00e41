-- claim.sql - pgbench script: the minimum SQL one new idempotency key costs the authority, as idemgate runs it
-- (two autocommit statements): the claim (INSERT .. ON CONFLICT DO NOTHING under the primary key) and the
-- fenced completion (UPDATE .. WHERE token = the claim's token) storing a small response.
-- bench.sh creates bench_keys as `LIKE idemgate_keys INCLUDING ALL` (same columns, constraints, indexes).
\set r random(1, 4611686018427387903)
\set tok random(1, 4611686018427387903)
INSERT INTO bench_keys (route, scope, key, fingerprint, state, token, lease_until, created_at, expires_at)
  VALUES ('bench', '\xe3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855'::bytea,
          'ck-' || :client_id || '-' || :r,
          '\x2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae'::bytea,
          'in_flight', :tok, now() + interval '60 s', now(), now() + interval '24 h')
  ON CONFLICT DO NOTHING;
UPDATE bench_keys SET state = 'completed', status = 200, response = decode(repeat('5a', 400), 'hex'),
       completed_at = now(), expires_at = now() + interval '24 h'
  WHERE route = 'bench'
    AND scope = '\xe3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855'::bytea
    AND key = 'ck-' || :client_id || '-' || :r AND token = :tok;
