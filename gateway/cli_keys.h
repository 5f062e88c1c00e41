/* cli_keys.h - the `idemgate keys` command (SPEC 11): list, show, release, purge and settle keys over the admin API. */
#ifndef IDEMGATE_GW_CLI_KEYS_H
#define IDEMGATE_GW_CLI_KEYS_H

/* Runs the command; argv[0] is "keys". Returns the exit code: 0 done, 1 an error answer or none, 2 a usage error. */
int gw_cli_keys_main(int argc, char **argv);

#endif
